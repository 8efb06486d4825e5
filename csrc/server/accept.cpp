// Accepting connections: the per-server and per-peer connection limits, socket options, and
// pausing when the process runs out of file descriptors.
#include <fcntl.h>
#include <sys/resource.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "net/socket_options.hpp"
#include "server/listener.hpp"
#include "server/server_impl.hpp"

namespace elasticstore {

// Connections accepted per wake-up of the listener: a default listen backlog (somaxconn, 4,096)
// is emptied in one wake-up (a full backlog drops connects, which the clients' kernels retry only
// after their 1 s SYN timeout), while under a flood the connections already accepted still get a
// turn between wake-ups.
inline constexpr std::size_t kMaxAcceptsPerWakeup = 4'096;

// Dead-peer detection (ServerConfig's keepalive fields): probes after the idle time, the count of
// unanswered ones that ends the connection, and TCP_USER_TIMEOUT, so that data the peer never
// acknowledges ends it within the same bound. With a user timeout the kernel ignores the count:
// each time the keepalive timer fires it ends the connection once the peer has been silent for the
// user timeout. The timer fires at idle + k * interval after the last packet received, a hair
// short of that when measured, so a user timeout of exactly the bound would wait one more
// interval; half an interval less ends it at the count-th interval, as without a user timeout.
// A refused option is logged; the connection is served anyway.
void Server::Impl::set_keepalive(int fd, const std::string& peer) const {
  KeepaliveOptions opts;
  opts.idle_s = static_cast<int>(cfg_.keepalive_idle_ms / 1000);
  opts.interval_s = static_cast<int>(cfg_.keepalive_interval_ms / 1000);
  opts.count = static_cast<int>(cfg_.keepalive_count);
  const uint64_t user_timeout = keepalive_bound_ms(cfg_) - cfg_.keepalive_interval_ms / 2;
  opts.user_timeout_ms = static_cast<unsigned>(std::min<uint64_t>(user_timeout, INT_MAX));
  if (const char* refused = elasticstore::set_keepalive(fd, opts)) {
    log(LogLevel::Warning, "connection %s: cannot set %s (%s): a peer gone silent may hold it "
        "longer than the keepalive bound", peer.c_str(), refused, std::strerror(errno));
  }
}

// Raises the soft descriptor limit to the hard one (a server is made to hold connections), and
// keeps connections that have not authenticated to a share of it, so that the rest stays for
// those that did.
void Server::Impl::raise_fd_limit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  if (lim.rlim_cur < lim.rlim_max) {
    const rlim_t was = lim.rlim_cur;
    lim.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &lim) == 0) {
      log(LogLevel::Info, "raised the open-file limit from %llu to %llu",
          static_cast<unsigned long long>(was), static_cast<unsigned long long>(lim.rlim_max));
    } else {
      log(LogLevel::Warning, "cannot raise the open-file limit from %llu to %llu: %s",
          static_cast<unsigned long long>(was), static_cast<unsigned long long>(lim.rlim_max),
          std::strerror(errno));
      ::getrlimit(RLIMIT_NOFILE, &lim);
    }
  }
  if (lim.rlim_cur != RLIM_INFINITY)
    half_open_cap_ = std::clamp<std::size_t>(static_cast<std::size_t>(lim.rlim_cur / kHalfOpenFdShare), 1,
                                             kMaxHalfOpen);
}

void Server::Impl::enter_half_open(Connection* c) {
  std::list<ConnId>& mine = half_open_by_peer_[c->peer_ip];
  c->half_open_pos = half_open_.insert(half_open_.end(), c->id());
  c->half_open_peer_pos = mine.insert(mine.end(), c->id());
  c->half_open = true;
}

void Server::Impl::leave_half_open(Connection* c) noexcept {
  if (!c->half_open) return;
  c->half_open = false;
  half_open_.erase(c->half_open_pos);
  auto it = half_open_by_peer_.find(c->peer_ip);
  it->second.erase(c->half_open_peer_pos);
  if (it->second.empty()) half_open_by_peer_.erase(it);
}

// Past kMaxHalfOpenPerPeer from `ip`, or half_open_cap_ in all, closes the oldest connections
// that have not finished their handshake (that peer's, then anyone's). Each is first given what
// it already sent: a client whose handshake waits in its socket (the loop has not read it yet)
// finishes it and leaves the count instead of being closed; one that sent nothing or only part
// of it is closed. So the bound holds, and a client that handshakes promptly is never the one shed.
void Server::Impl::shed_half_open(const std::string& ip) {
  auto make_room = [this](ConnId id, const char* why) {
    Connection* c = conns_.at(id).get();
    on_conn(c, kReadable);
    if (!c->half_open) return;  // served (or closed): no longer counted
    c->fail(std::string("closed before its handshake finished: ") + why, false);
    ++shed_half_open_;
    mark_closing(c);
  };
  for (;;) {
    auto it = half_open_by_peer_.find(ip);
    if (it == half_open_by_peer_.end() || it->second.size() <= kMaxHalfOpenPerPeer) break;
    make_room(it->second.front(), "its peer address has the most connections not yet authenticated "
                                  "(kMaxHalfOpenPerPeer)");
  }
  while (half_open_.size() > half_open_cap_)
    make_room(half_open_.front(), "the server holds the most connections not yet authenticated it "
                                  "keeps (kMaxHalfOpen, or half the open-file limit)");
}

void Server::Impl::on_accept(EventLoop&, int, void* data, uint32_t) {
  static_cast<Impl*>(data)->accept_all();
}

// Accepts up to kMaxAcceptsPerWakeup connections (until EAGAIN), then returns to the loop so that
// the connections already accepted are served too; the listener is level-triggered, so the rest of
// the backlog is accepted on the next wake-up. An accept does no more than it must (no read: the
// loop reads a connection when it is readable), so that under a storm the backlog is emptied
// faster than the clients' connects fill it; measured at 16,384 clients, a read and handshake
// reply at accept made the backlog overflow (thousands of connects dropped, each retried after
// 1 s).
void Server::Impl::accept_all() {
  const uint64_t shed_before = shed_half_open_;
  for (std::size_t accepted = 0; accepted < kMaxAcceptsPerWakeup; ++accepted) {
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
    set_nodelay(fd);
    if (keepalive_enabled(cfg_)) set_keepalive(fd, peer);
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
    Connection* added = conn.get();
    conns_.emplace(id, std::move(conn));
    ++accepted_;
    enter_half_open(added);
    // Past the half-open bounds the oldest are given what they sent first (shed_half_open): a
    // client whose handshake waits in its socket is served, never shed.
    shed_half_open(added->peer_ip);
    // A shed connection's descriptor is closed when it is reaped, before the next poll: accept
    // the rest of the backlog then (the listener stays readable), not before.
    if (shed_half_open_ != shed_before) return;
  }
}

// Out of descriptors: the pending connection would make a level-triggered listener spin. Free
// the reserve fd to accept and close it (the peer learns at once), then pause accepting.
void Server::Impl::out_of_fds(int err) {
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

}  // namespace elasticstore
