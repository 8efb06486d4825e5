// A blocking client for the native protocol (docs/protocol.md) on one TCP connection.
// C++17, no Python, no torch. Every wait is a poll() against a deadline on the monotonic clock.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "client/stats.hpp"
#include "wire/protocol.hpp"

namespace elasticstore {

// ---- errors -----------------------------------------------------------------------------------
// Every error the client raises derives from StoreError. A plain StoreError is an ERROR,
// WRONG_TYPE or TOO_LARGE reply, an argument refused before sending, or a protocol violation by
// the server (ProtocolError, which also closes the connection); a failed handshake is an
// AuthenticationError.
class StoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// The server answered TIMEOUT: the condition did not hold within the timeout.
class TimeoutError : public StoreError {
 public:
  using StoreError::StoreError;
};
// Connect failure, reset, EOF, or no reply within the client-side deadline (the message names
// the operation and its key(s)). The connection is closed; the next call reconnects (a new
// session).
class NetworkError : public StoreError {
 public:
  using StoreError::StoreError;
};
// The server broke the protocol (mismatched request id, malformed reply). The connection is closed.
class ProtocolError : public StoreError {
 public:
  using StoreError::StoreError;
};
// A WATCH whose changes were dropped from the server's history.
class CompactedError : public StoreError {
 public:
  CompactedError(const std::string& what, uint64_t oldest_revision)
      : StoreError(what), oldest_revision_(oldest_revision) {}
  uint64_t oldest_revision() const { return oldest_revision_; }

 private:
  uint64_t oldest_revision_;
};
// The handshake failed to authenticate: wrong or missing token on either side, or a server that
// could not prove it holds the client's token. The connection is closed; no key was touched.
// Not retried: reconnecting cannot fix it.
class AuthenticationError : public StoreError {
 public:
  using StoreError::StoreError;
};
// ClientOptions::interrupt_check returned true while waiting. The connection is closed.
class InterruptedError : public StoreError {
 public:
  using StoreError::StoreError;
};

// ---- options ----------------------------------------------------------------------------------
// A timeout in milliseconds; negative means no timeout, zero means "do not block".
using Timeout = std::chrono::milliseconds;
inline constexpr Timeout kForever{-1};

struct ClientOptions {
  // How long the constructor (and clone()) keeps retrying, with backoff, to connect;
  // negative: forever.
  Timeout connect_timeout{300'000};
  // How long the first call after the connection broke keeps retrying to reconnect (at most
  // connect_timeout and op_timeout), so that a call on a dead server fails within this time.
  Timeout reconnect_timeout{30'000};
  // Bounds every call (Client::set_op_timeout changes it): reconnecting, sending, and the reply
  // to a request that does not block server-side all finish within it from the call's start. A
  // request that blocks server-side with timeout t gets its reply within t plus a slack.
  Timeout op_timeout{300'000};
  // Sent in HELLO (at most kMaxClientNameBytes).
  std::string client_name;
  // The server instance a connection must reach (the tag of its session ids, protocol.hpp
  // kSessionCounterBits); 0: whichever answers first, whose tag is then kept. clone() passes
  // its client's on, so a clone never reaches a restarted server either.
  uint64_t server_tag = 0;
  // The server's shared token (docs/authentication.md); empty: connect without authentication.
  // With one, the client proves it in the handshake and refuses a server that cannot prove it.
  std::string token;
  // Polled at least every kInterruptPollMs while waiting; returning true closes the connection
  // and throws InterruptedError. Called without any lock of the client held by the caller thread
  // other than the client's own call mutex.
  std::function<bool()> interrupt_check;
  // Whether the calling thread can be interrupted at all, asked once per wait (e.g. only the
  // main thread takes signals in Python). Where it returns false, waits are not sliced, so a
  // thousand threads blocked in wait() do not each wake ten times a second. Unset: always.
  std::function<bool()> interruptible;
};

inline constexpr int kInterruptPollMs = 100;

// ---- results ----------------------------------------------------------------------------------
struct CompareSetResult {
  bool swapped = false;
  bool exists = false;  // false: the key is missing (and current is empty)
  std::string current;  // the value stored after the call
};

struct WatchEvent {
  EventKind kind = EventKind::Set;
  std::string key;
  std::string value;
  uint64_t revision = 0;
};

// What a call is about (a key, a labelled key, or keys), named in its network errors. Views:
// valid for the call. Internal to the client.
struct CallSubject {
  CallSubject() = default;
  CallSubject(std::string_view k, const char* l = "") : key(k), label(l), has_key(true) {}
  CallSubject(const std::vector<std::string>& ks) : keys(&ks) {}
  std::string describe() const;
  std::string_view key;
  const std::vector<std::string>* keys = nullptr;
  const char* label = "";
  bool has_key = false;
};

// ---- the client -------------------------------------------------------------------------------
class ClientTransport;  // client/transport.hpp

// Thread-safe: one mutex serializes calls on the connection (use clone() for parallel calls).
// A thread waiting for the mutex polls interrupt_check too (InterruptedError without closing the
// connection, which another call is using).
// A broken connection is re-established by the next call; a request that failed after it was
// (partly) sent is never retried (it may have been applied): it throws NetworkError.
// fork(): a call in the child drops the connection inherited from the parent (closing its file
// descriptor without sending on it or shutting it down) and makes its own.
class Client {
 public:
  // Connects, retrying with jittered exponential backoff until options.connect_timeout.
  Client(std::string host, uint16_t port, ClientOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::string& host() const { return host_; }
  uint16_t port() const { return port_; }
  // The session of the current connection (changes on reconnect); 0 when not connected.
  uint64_t session_id() const { return session_id_.load(std::memory_order_relaxed); }
  bool connected() const;
  const ClientOptions& options() const { return options_; }
  // The bound of every call (ClientOptions::op_timeout); thread-safe, applies to the next call.
  Timeout op_timeout() const { return Timeout(op_timeout_ms_.load(std::memory_order_relaxed)); }
  void set_op_timeout(Timeout t) { op_timeout_ms_.store(t.count(), std::memory_order_relaxed); }
  // The bound of connecting again (ClientOptions::connect_timeout, with reconnect_timeout);
  // thread-safe, applies to the next reconnect and to clones.
  Timeout connect_timeout() const {
    return Timeout(connect_timeout_ms_.load(std::memory_order_relaxed));
  }
  void set_connect_timeout(Timeout t) {
    connect_timeout_ms_.store(t.count(), std::memory_order_relaxed);
  }

  // A new connection (a new session) to the same server with the same options.
  std::unique_ptr<Client> clone() const;
  // Closes the connection for good; a call in progress on another thread is aborted with
  // NetworkError. Later calls throw NetworkError. Idempotent.
  void close();

  uint64_t set(std::string_view key, std::string_view value, bool ephemeral = false);
  std::string get(std::string_view key, Timeout timeout);
  std::optional<std::pair<std::string, uint64_t>> try_get(std::string_view key);
  int64_t add(std::string_view key, int64_t delta);
  CompareSetResult compare_set(std::string_view key, std::string_view expected,
                               std::string_view desired, bool ephemeral = false);
  void wait(const std::vector<std::string>& keys, Timeout timeout);
  bool check(const std::vector<std::string>& keys);
  bool delete_key(std::string_view key);
  int64_t num_keys();
  std::vector<std::string> list_keys(std::string_view prefix = {});
  uint64_t append(std::string_view key, std::string_view value);
  std::vector<std::string> multi_get(const std::vector<std::string>& keys, Timeout timeout);
  uint64_t multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values);
  int64_t queue_push(std::string_view queue, std::string_view value);
  // Timeout 0: nullopt when the queue is empty. Otherwise throws TimeoutError when it passes.
  std::optional<std::string> queue_pop(std::string_view queue, Timeout timeout);
  int64_t queue_len(std::string_view queue);
  void ping();
  // ALLOW_PEERS: lets these addresses or CIDRs use torch's TCPStore protocol on a server with a
  // token (the job vouches for them, e.g. the rendezvous for a round's members).
  void allow_peers(const std::vector<std::string>& addrs);
  // Returns the generation released (0, 1, 2, ...).
  uint64_t barrier(std::string_view key, int64_t world_size, Timeout timeout);
  // The first change after after_revision (nullopt: after now) to key, or under it when prefix.
  WatchEvent watch(std::string_view key, std::optional<uint64_t> after_revision, Timeout timeout,
                   bool prefix = false);
  std::vector<std::pair<std::string, uint64_t>> stats();

 private:
  using Clock = std::chrono::steady_clock;
  struct Reply {
    uint8_t status = 0;
    std::string_view payload;  // valid until the next request
  };
  using Subject = CallSubject;

  // Takes mu_ for one call, polling interrupt_check and close() while another call holds it.
  std::unique_lock<std::timed_mutex> lock_call();

  // One call in progress: holds mu_ and, when it ends, adds the call to call_stats (client/stats.hpp)
  // with its time since start_call(): Ok when it returned, failure_ when it threw.
  class Call {
   public:
    Call(Client& client, Op op, Clock::time_point start, std::unique_lock<std::timed_mutex> lock);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

   private:
    std::unique_lock<std::timed_mutex> lock_;  // released after the destructor's body
    Client& client_;
    const Op op_;
    const Clock::time_point start_;
    const int exceptions_;  // std::uncaught_exceptions() at the start
  };
  // Every operation that sends a request starts with this (after checking its arguments). A
  // failure to take mu_ (closed, interrupted) is recorded too.
  Call start_call(Op op);

  // Connection management (all *_locked methods need mu_ held). The socket, connecting with
  // backoff and waiting against deadlines are the transport's (client/transport.hpp).
  void connect_locked(Timeout timeout);
  void handshake_locked(Clock::time_point deadline);
  void check_same_server_locked();
  void authenticate_locked(Clock::time_point deadline, const std::string& client_nonce,
                           std::string_view server_nonce);
  [[noreturn]] void fail_auth_locked(const std::string& why);
  void ensure_connected_locked();
  void close_fd_locked();

  // One exchange: begin_locked() starts the call's deadline (op_timeout from call_start_),
  // checks the client, (re)connects and starts the frame; exchange_locked() finishes it, sends it
  // and reads the matching reply. server_timeout_ms is the timeout sent to the server (kNoTimeout) or
  // kNotBlocking for requests that never block. Their network errors name op and subject.
  Writer begin_locked(Op op, Subject subject = {});
  [[noreturn]] void rethrow_network_locked(const NetworkError& e, Op op);
  Reply exchange_locked(Writer& w, Op op, uint32_t server_timeout_ms);
  Reply wait_for_keys_locked(Op op, const std::vector<std::string>& keys, Timeout timeout);
  Reply read_reply_locked(uint32_t request_id, Clock::time_point deadline, Op op,
                          uint32_t server_timeout_ms, Clock::time_point sent_at);

  // Throws StoreError for an error reply, ProtocolError for any status other than OK.
  // subject() (e.g. the quoted key) is called only to build the error message.
  template <typename Subject>
  void expect_ok_locked(const Reply& r, Op op, Subject&& subject) {
    if (r.status != static_cast<uint8_t>(Status::Ok)) fail_status_locked(r, op, subject());
  }
  [[noreturn]] void fail_status_locked(const Reply& r, Op op, const std::string& subject);
  void finish_locked(const Reader& rd, Op op);
  void check_not_closed() const;
  [[noreturn]] void fail_protocol_locked(const std::string& what);
  std::string endpoint() const;

  std::string host_;
  uint16_t port_;
  ClientOptions options_;

  // Serializes calls. Timed, so that a thread waiting for another thread's call still honours
  // interrupt_check and close().
  mutable std::timed_mutex mu_;
  // The socket, its buffered reply bytes and the close() signal; never null.
  std::unique_ptr<ClientTransport> conn_;
  std::atomic<uint64_t> session_id_{0};
  std::atomic<uint64_t> server_tag_{0};  // of the server instance reached first (connect.cpp)
  std::atomic<bool> connected_{false};
  uint32_t next_request_id_ = 1;
  std::string wbuf_;         // the request being built; reused
  uint32_t request_id_ = 0;  // of the request being built
  std::atomic<int64_t> op_timeout_ms_;
  std::atomic<int64_t> connect_timeout_ms_;
  // Of the call in progress: when it took mu_ (start_call), and op_timeout from then.
  Clock::time_point call_start_{};
  Clock::time_point call_deadline_{};
  Subject subject_;                    // of the call in progress
  // The outcome recorded if the call in progress throws: Network once a NetworkError passed
  // rethrow_network_locked, Timeout once the server answered TIMEOUT, else Error.
  call_stats::Outcome failure_ = call_stats::Outcome::Error;
  std::minstd_rand rng_;
};

}  // namespace elasticstore
