#include "server.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <unordered_map>

#include "auth.hpp"
#include "buffer.hpp"
#include "connection.hpp"
#include "event_loop.hpp"
#include "kv_state.hpp"
#include "listener.hpp"

namespace elasticstore {
namespace {

// How long accepting pauses when the process is out of file descriptors.
constexpr uint64_t kAcceptBackoffMs = 100;

constexpr const char* kStatNames[] = {
    "connections",      "keys",           "waiters",
    "revision",         "queues",         "history_events",
    "bytes_buffered",   "connections_accepted", "connections_refused",
    "connections_closed_bad_input", "requests", "barriers",
};
constexpr std::size_t kNumStats = sizeof kStatNames / sizeof kStatNames[0];

std::vector<Cidr> parse_ranges(const std::vector<std::string>& texts) {
  std::vector<Cidr> out(texts.size());
  std::string error;
  for (std::size_t i = 0; i < texts.size(); ++i)
    if (!parse_cidr(texts[i], &out[i], &error)) throw std::invalid_argument("allow_unauthenticated_from: " + error);
  return out;
}

const std::string& checked_token(const std::string& token) {
  if (!token.empty() && token.size() > kMaxTokenBytes) throw std::invalid_argument(token_problem(token));
  return token;
}

}  // namespace

class Server::Impl final : public ConnectionHost {
 public:
  explicit Impl(ServerConfig cfg)
      : cfg_(std::move(cfg)),
        auth_{checked_token(cfg_.token), PeerAllowList(cfg_.allow_loopback, parse_ranges(cfg_.allow_unauthenticated_from))},
        loop_(new EventLoop()),
        kv_(&EventLoop::now_ms, cfg_.limits) {
    std::string error;
    if (!auth_.allowed.set(cfg_.allowed_peers, &error)) throw std::invalid_argument("allowed_peers: " + error);
    listen_fd_ = open_listener(cfg_);
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
    host_ = numeric_address(ss, false);
    port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    warn_if_exposed(ss);
    reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    scratch_.resize(kReadScratchBytes);
    if (!loop_->add(listen_fd_, kReadable, &Impl::on_accept, this)) {
      const int err = errno;
      close_fds();
      throw std::system_error(err, std::generic_category(), "epoll_ctl(listen)");
    }
    loop_->set_before_sleep([this] { before_sleep(); });
    publish();
  }
  ~Impl() override { stop(); }

  void start() {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopped_) throw std::runtime_error("a stopped Server cannot be restarted");
    if (thread_.joinable()) return;
    running_ = true;
    thread_ = std::thread([this] { run(); });
  }

  void stop() noexcept {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopped_) return;
    stopped_ = true;
    if (thread_.joinable()) {
      loop_->stop();
      thread_.join();
    }
    running_ = false;
    publish();
    by_fd_.clear();
    dirty_.clear();
    closing_.clear();
    conns_.clear();  // each Connection closes its socket
    close_fds();
  }

  void close_fds() noexcept {
    if (listen_fd_ >= 0) ::close(listen_fd_);
    if (reserve_fd_ >= 0) ::close(reserve_fd_);
    listen_fd_ = reserve_fd_ = -1;
    loop_.reset();  // the epoll fd and the wake-up eventfd
  }

  StatsList stats_published() const {
    StatsList out;
    for (std::size_t i = 0; i < kNumStats; ++i) out.emplace_back(kStatNames[i], published_[i].load());
    return out;
  }

  // One line when a non-loopback address is bound without a token.
  void warn_if_exposed(const sockaddr_storage& ss) const {
    if (auth_.required() || is_loopback(ss)) return;
    log(LogLevel::Warning,
        "listening on %s:%u without a token: anyone who can reach this port can read and write "
        "every key (and torch's rendezvous unpickles what it reads); set a token (--token-file)",
        host_.c_str(), static_cast<unsigned>(port_));
  }

  ServerAuth& server_auth() noexcept { return auth_; }

  // ---- ConnectionHost ----
  ServerAuth& auth() noexcept override { return auth_; }
  KvState& kv() noexcept override { return kv_; }
  StatsList stats_snapshot() const override {
    const auto v = collect();
    StatsList out;
    for (std::size_t i = 0; i < kNumStats; ++i) out.emplace_back(kStatNames[i], v[i]);
    return out;
  }
  // Completions name the keys whose values they return; the codec reads them while encoding. So
  // that none of them is deleted in between, a session closed during the drain (a reply that did
  // not fit) is ended only after the batch is encoded; its deletions wake the next batch.
  void drain_ready() override {
    if (draining_) return;  // the outer drain picks up what a nested close queued
    draining_ = true;
    for (;;) {
      if (!kv_.take_ready(&batch_)) {
        if (ending_.empty()) break;
        std::vector<ConnId> ending;
        ending.swap(ending_);
        for (ConnId id : ending) kv_.close_session(id);
        continue;
      }
      for (const Completion& c : batch_) {
        auto it = conns_.find(c.conn);
        if (it == conns_.end()) continue;
        Connection* conn = it->second.get();
        if (conn->state() == ConnState::Closing) continue;
        if (!conn->deliver(c, kv_, buffer_room(), cfg_.max_buffered_bytes)) {
          mark_closing(conn);
          continue;
        }
        account(conn);
        if (!conn->dirty) {
          conn->dirty = true;
          dirty_.push_back(conn);
        }
      }
    }
    draining_ = false;
  }

  void count_request() noexcept override { ++requests_; }
  std::size_t buffer_room() const noexcept {
    return bytes_buffered_ < cfg_.max_buffered_bytes ? cfg_.max_buffered_bytes - bytes_buffered_ : 0;
  }

  const std::string& host() const noexcept { return host_; }
  uint16_t port() const noexcept { return port_; }
  bool running() const noexcept { return running_.load(); }

 private:
  void run() noexcept {
    try {
      loop_->run();
    } catch (const std::exception& e) {
      log(LogLevel::Error, "event loop stopped by an exception: %s", e.what());
    } catch (...) {
      log(LogLevel::Error, "event loop stopped by an unknown exception");
    }
    running_ = false;
  }

  std::array<uint64_t, kNumStats> collect() const {
    return {conns_.size() - closing_.size(), kv_.num_keys(),   kv_.waiter_count(), kv_.revision(),
            kv_.queue_count(),    kv_.history_size(), bytes_buffered_, accepted_,
            refused_,             closed_bad_input_, requests_, kv_.barrier_count()};
  }
  void publish() noexcept {
    const auto v = collect();
    for (std::size_t i = 0; i < kNumStats; ++i) published_[i].store(v[i], std::memory_order_relaxed);
  }

  void account(Connection* c) noexcept {
    const std::size_t now = c->buffered_bytes();
    bytes_buffered_ = bytes_buffered_ + now - c->accounted;
    c->accounted = now;
  }

  // ---- accepting ----
  static void on_accept(EventLoop&, int, void* data, uint32_t) {
    static_cast<Impl*>(data)->accept_all();
  }

  void accept_all() {
    for (;;) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
          return out_of_fds(errno);
        log(LogLevel::Error, "accept failed: %s", std::strerror(errno));
        return;
      }
      std::string peer = numeric_address(ss, true);
      std::string ip = numeric_address(ss, false);
      if (conns_.size() >= cfg_.max_connections) {
        log(LogLevel::Warning, "refusing connection %s: max_connections (%zu) reached", peer.c_str(),
            cfg_.max_connections);
        ::close(fd);
        ++refused_;
        continue;
      }
      std::size_t& from_peer = per_peer_[ip];
      if (from_peer >= cfg_.max_connections_per_peer) {
        log(LogLevel::Warning, "refusing connection %s: %zu connections from %s, the limit "
            "(max_connections_per_peer)", peer.c_str(), from_peer, ip.c_str());
        ::close(fd);
        ++refused_;
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      const ConnId id = next_id_++;
      auto conn = std::make_unique<Connection>(fd, id, std::move(peer), cfg_.max_connection_buffer_bytes);
      conn->peer_addr = ss;
      if (!loop_->add(fd, kReadable, &Impl::on_conn_event, this)) {
        log(LogLevel::Error, "cannot watch connection %s", conn->peer().c_str());
        if (from_peer == 0) per_peer_.erase(ip);
        continue;  // the Connection closes fd
      }
      ++from_peer;
      conn->peer_ip = std::move(ip);
      conn->handshake_timer =
          loop_->add_timer(cfg_.handshake_timeout_ms, [this, id] { handshake_timeout(id); });
      conn->events = kReadable;
      if (by_fd_.size() <= static_cast<std::size_t>(fd)) by_fd_.resize(static_cast<std::size_t>(fd) + 1);
      by_fd_[static_cast<std::size_t>(fd)] = conn.get();
      kv_.open_session(id);
      conns_.emplace(id, std::move(conn));
      ++accepted_;
    }
  }

  // Out of descriptors: the pending connection would make a level-triggered listener spin. Free
  // the reserve fd to accept and close it (the peer learns at once), then pause accepting.
  void out_of_fds(int err) {
    if (reserve_fd_ >= 0) {
      ::close(reserve_fd_);
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        ::close(fd);
        ++refused_;
      }
      reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    log(LogLevel::Warning, "accept: %s; refusing connections for %llu ms", std::strerror(err),
        static_cast<unsigned long long>(kAcceptBackoffMs));
    loop_->modify(listen_fd_, 0);
    loop_->add_timer(kAcceptBackoffMs, [this] { loop_->modify(listen_fd_, kReadable); });
  }

  // ---- connection events ----
  static void on_conn_event(EventLoop&, int fd, void* data, uint32_t mask) {
    auto* self = static_cast<Impl*>(data);
    if (static_cast<std::size_t>(fd) >= self->by_fd_.size()) return;
    Connection* c = self->by_fd_[static_cast<std::size_t>(fd)];
    if (c && c->state() != ConnState::Closing) self->on_conn(c, mask);
  }

  void on_conn(Connection* c, uint32_t mask) {
    if ((mask & kWritable) && (c->events & kWritable)) flush(c);
    if ((mask & kReadable) && c->state() != ConnState::Closing) {
      try {
        c->on_readable(*this, scratch_.data(), scratch_.size());
      } catch (const std::bad_alloc&) {
        c->fail("out of memory while handling its request", false);
      }
      if (c->state() != ConnState::Closing) {
        account(c);
        if (bytes_buffered_ > cfg_.max_buffered_bytes) over_budget(c);
      }
      if (c->state() != ConnState::Closing) {
        arm_frame_timer(c);
        publish();  // before the reply leaves, so a client that got it sees fresh stats()
        flush(c);  // the replies to everything this read completed, in one write
      }
    }
    if (c->state() == ConnState::Closing) mark_closing(c);
  }

  // A request that started must finish within kFrameTimeoutMs; the clock restarts whenever a
  // request completes, so a busy pipelining client is never cut off.
  void arm_frame_timer(Connection* c) {
    if (!c->has_partial_request()) {
      if (c->frame_timer) loop_->cancel_timer(c->frame_timer);
      c->frame_timer = 0;
    } else if (!c->frame_timer || c->progressed()) {
      if (c->frame_timer) loop_->cancel_timer(c->frame_timer);
      const ConnId id = c->id();
      c->frame_timer = loop_->add_timer(cfg_.frame_timeout_ms, [this, id] { frame_timeout(id); });
    }
  }

  void frame_timeout(ConnId id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    Connection* c = it->second.get();
    c->frame_timer = 0;
    c->fail("request not finished within " + std::to_string(cfg_.frame_timeout_ms) + " ms", true);
    mark_closing(c);
  }

  void handshake_timeout(ConnId id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    Connection* c = it->second.get();
    c->handshake_timer = 0;
    if (c->state() != ConnState::AwaitingPreamble && c->state() != ConnState::Handshaking) return;
    c->fail("handshake not finished within " + std::to_string(cfg_.handshake_timeout_ms) + " ms", true);
    mark_closing(c);
  }

  void over_budget(Connection* c) {
    c->fail("dropped to keep the server's buffers within their budget of " +
                std::to_string(cfg_.max_buffered_bytes) + " bytes across connections (" +
                std::to_string(c->buffered_bytes()) + " of " + std::to_string(bytes_buffered_) +
                " are this connection's)",
            false);
  }

  // Sends what the kernel takes; when that ends a pause, handles the requests it held back (which
  // may pause it again). Reading is masked while paused, writing is watched while output is left.
  void flush(Connection* c) {
    for (;;) {
      if (c->state() == ConnState::Closing) return;
      if (!c->flush()) return mark_closing(c);
      if (c->paused() || !c->input_held()) break;
      if (!c->resume(*this)) return mark_closing(c);
      arm_frame_timer(c);
    }
    const uint32_t want = (c->paused() ? 0u : kReadable) | (c->wants_write() ? kWritable : 0u);
    if (want != c->events) {
      loop_->modify(c->fd(), want);
      c->events = want;
    }
    account(c);
  }

  // Logs why, ends the session at once (its ephemeral keys go, waking watchers elsewhere), and
  // queues the object for reaping before the next poll, so no fd is reused within a batch.
  void mark_closing(Connection* c) {
    if (c->queued_close) return;
    c->queued_close = true;
    const bool quiet = c->close_reason() == "peer closed";
    if (c->bad_input()) ++closed_bad_input_;
    log(c->bad_input() ? LogLevel::Warning : quiet ? LogLevel::Debug : LogLevel::Info,
        "closing connection %s: %s", c->peer().c_str(), c->close_reason().c_str());
    loop_->remove(c->fd());
    if (c->frame_timer) loop_->cancel_timer(c->frame_timer);
    if (c->handshake_timer) loop_->cancel_timer(c->handshake_timer);
    c->frame_timer = c->handshake_timer = 0;
    account(c);
    closing_.push_back(c);
    if (draining_) {  // see drain_ready(): ended once the batch being encoded is done
      ending_.push_back(c->id());
      return;
    }
    kv_.close_session(c->id());
    drain_ready();
  }

  void before_sleep() {
    reap();
    arm_waiter_timer();
    publish();
    for (std::size_t i = 0; i < dirty_.size(); ++i) {  // flushing may close and append
      dirty_[i]->dirty = false;
      flush(dirty_[i]);
    }
    dirty_.clear();
    reap();
  }

  void reap() noexcept {
    for (Connection* c : closing_) {
      if (c->dirty) dirty_.erase(std::remove(dirty_.begin(), dirty_.end(), c), dirty_.end());
      by_fd_[static_cast<std::size_t>(c->fd())] = nullptr;
      bytes_buffered_ -= c->accounted;
      if (auto p = per_peer_.find(c->peer_ip); p != per_peer_.end() && --p->second == 0) per_peer_.erase(p);
      conns_.erase(c->id());
    }
    closing_.clear();
  }

  // One loop timer tracks the earliest waiter deadline; KvState keeps the ordered deadlines.
  void arm_waiter_timer() {
    const uint64_t next = kv_.next_deadline();
    if (next == waiter_deadline_) return;
    if (waiter_timer_) loop_->cancel_timer(waiter_timer_);
    waiter_timer_ = 0;
    waiter_deadline_ = next;
    if (next == kNoDeadline) return;
    const uint64_t now = EventLoop::now_ms();
    waiter_timer_ = loop_->add_timer(next > now ? next - now : 0, [this] {
      waiter_timer_ = 0;
      waiter_deadline_ = kNoDeadline;
      kv_.expire(EventLoop::now_ms());
      drain_ready();
    });
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
  std::vector<Connection*> by_fd_;
  std::vector<Connection*> dirty_;    // replies appended, not yet flushed
  std::vector<Connection*> closing_;  // closed sessions awaiting reaping
  std::vector<Completion> batch_;
  std::vector<ConnId> ending_;        // sessions to end once the current drain batch is encoded
  std::vector<char> scratch_;
  bool draining_ = false;
  ConnId next_id_ = 1;
  EventLoop::TimerId waiter_timer_ = 0;
  uint64_t waiter_deadline_ = kNoDeadline;
  uint64_t bytes_buffered_ = 0, accepted_ = 0, refused_ = 0, closed_bad_input_ = 0, requests_ = 0;
  std::array<std::atomic<uint64_t>, kNumStats> published_{};

  std::mutex mu_;  // start/stop from any thread
  std::thread thread_;
  std::atomic<bool> running_{false};
  bool stopped_ = false;
};

Server::Server(ServerConfig config) {
  validate_config(config);
  set_log_level(config.log_level);
  impl_ = std::make_unique<Impl>(std::move(config));
}
Server::~Server() { stop(); }
const std::string& Server::host() const noexcept { return impl_->host(); }
uint16_t Server::port() const noexcept { return impl_->port(); }
void Server::start() { impl_->start(); }
void Server::stop() noexcept { impl_->stop(); }
bool Server::running() const noexcept { return impl_->running(); }
std::vector<std::pair<std::string, uint64_t>> Server::stats() const { return impl_->stats_published(); }
void Server::allow_peer(const std::string& addr) {
  std::string error;
  if (!impl_->server_auth().allowed.add(addr, &error)) throw std::invalid_argument(error);
}
void Server::set_allowed_peers(const std::vector<std::string>& addrs) {
  std::string error;
  if (!impl_->server_auth().allowed.set(addrs, &error)) throw std::invalid_argument(error);
}
std::vector<std::string> Server::allowed_peers() const { return impl_->server_auth().allowed.peers(); }
bool Server::requires_token() const noexcept { return impl_->server_auth().required(); }

}  // namespace elasticstore
