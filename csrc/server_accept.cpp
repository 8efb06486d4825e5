// Accepting connections: the per-server and per-peer connection limits, socket options, and
// pausing when the process runs out of file descriptors.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "listener.hpp"
#include "server_impl.hpp"

namespace elasticstore {

void Server::Impl::on_accept(EventLoop&, int, void* data, uint32_t) {
  static_cast<Impl*>(data)->accept_all();
}

void Server::Impl::accept_all() {
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
