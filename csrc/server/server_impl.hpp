// Server::Impl, the server's state on its event-loop thread, shared by its parts:
//   server.cpp  construction, start/stop, statistics and the public Server API;
//   accept.cpp  accepting connections and the limits checked there;
//   conns.cpp   connection events, their timers, flushing, closing and reaping.
// Internal to the server (not installed); include only from those files.
#pragma once

#include <sys/socket.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "server/connection.hpp"
#include "server/event_loop.hpp"
#include "server/kv_state.hpp"
#include "server/server.hpp"
#include "wire/auth.hpp"

namespace elasticstore {

// How long accepting pauses when the process is out of file descriptors.
inline constexpr uint64_t kAcceptBackoffMs = 100;

// This instance's first session id: a random nonzero tag above kSessionCounterBits, counter 1
// (protocol.hpp: a client that reconnects tells a restarted server by its tag). server.cpp.
uint64_t first_session_id() noexcept;

inline constexpr const char* kStatNames[] = {
    "connections",      "keys",           "waiters",
    "revision",         "queues",         "history_events",
    "bytes_buffered",   "connections_accepted", "connections_refused",
    "connections_closed_bad_input", "requests", "barriers",
    "connections_closed_peer_lost", "connections_half_open", "connections_shed_half_open",
    "loop_slowest_pass_ms", "loop_latest_wake_ms",
};
inline constexpr std::size_t kNumStats = sizeof kStatNames / sizeof kStatNames[0];

class Server::Impl final : public ConnectionHost {
 public:
  explicit Impl(ServerConfig cfg);
  ~Impl() override { stop(); }

  void start();
  void stop() noexcept;
  StatsList stats_published() const;
  ServerAuth& server_auth() noexcept { return auth_; }

  // ---- ConnectionHost ----
  ServerAuth& auth() noexcept override { return auth_; }
  KvState& kv() noexcept override { return kv_; }
  StatsList stats_snapshot() const override;
  void drain_ready() override;
  void count_request() noexcept override { ++requests_; }

  std::size_t buffer_room() const noexcept {
    return bytes_buffered_ < cfg_.max_buffered_bytes ? cfg_.max_buffered_bytes - bytes_buffered_ : 0;
  }
  const std::string& host() const noexcept { return host_; }
  uint16_t port() const noexcept { return port_; }
  bool running() const noexcept { return running_.load(); }

 private:
  // server.cpp
  void close_fds() noexcept;
  void warn_if_exposed(const sockaddr_storage& ss) const;
  void run() noexcept;
  std::array<uint64_t, kNumStats> collect() const;
  void publish() noexcept;

  // accept.cpp
  static void on_accept(EventLoop&, int, void* data, uint32_t);
  void accept_all();
  void out_of_fds(int err);
  void set_keepalive(int fd, const std::string& peer) const;
  void raise_fd_limit();
  void enter_half_open(Connection* c);
  void leave_half_open(Connection* c) noexcept;
  void shed_half_open(const std::string& ip);

  // conns.cpp
  static void on_conn_event(EventLoop&, int fd, void* data, uint32_t mask);
  void on_conn(Connection* c, uint32_t mask);
  void arm_frame_timer(Connection* c);
  void frame_timeout(ConnId id);
  void handshake_timeout(ConnId id);
  void over_budget(Connection* c);
  void flush(Connection* c);
  void mark_closing(Connection* c);
  void before_sleep();
  void reap() noexcept;
  void arm_waiter_timer();
  void account(Connection* c) noexcept {
    const std::size_t now = c->buffered_bytes();
    bytes_buffered_ = bytes_buffered_ + now - c->accounted;
    c->accounted = now;
  }

  ServerConfig cfg_;
  ServerAuth auth_;
  std::unique_ptr<EventLoop> loop_;
  KvState kv_;
  int listen_fd_ = -1;
  int reserve_fd_ = -1;  // spent to shed a connection when out of descriptors
  std::string host_;
  uint16_t port_ = 0;
  std::unordered_map<ConnId, std::unique_ptr<Connection>> conns_;
  std::unordered_map<std::string, std::size_t> per_peer_;  // open connections per peer IP
  // Connections whose handshake is not done, oldest first: all, and per peer IP.
  std::list<ConnId> half_open_;
  std::unordered_map<std::string, std::list<ConnId>> half_open_by_peer_;
  std::size_t half_open_cap_ = kMaxHalfOpen;  // lowered to a share of the descriptor limit
  uint64_t shed_half_open_ = 0;
  std::vector<Connection*> by_fd_;
  std::vector<Connection*> dirty_;    // replies appended, not yet flushed
  std::vector<Connection*> closing_;  // closed sessions awaiting reaping
  std::vector<Completion> batch_;
  std::vector<ConnId> ending_;        // sessions to end once the current drain batch is encoded
  std::vector<char> scratch_;
  std::string keepalive_note_;  // how a lost peer was detected, for the log line
  bool draining_ = false;
  ConnId next_id_ = first_session_id();  // this instance's tag, then a counter (protocol.hpp)
  EventLoop::TimerId waiter_timer_ = 0;
  uint64_t waiter_deadline_ = kNoDeadline;
  uint64_t bytes_buffered_ = 0, accepted_ = 0, refused_ = 0, closed_bad_input_ = 0, requests_ = 0;
  uint64_t closed_peer_lost_ = 0;
  std::array<std::atomic<uint64_t>, kNumStats> published_{};

  std::mutex mu_;  // start/stop from any thread
  std::thread thread_;
  std::atomic<bool> running_{false};
  bool stopped_ = false;
};

}  // namespace elasticstore
