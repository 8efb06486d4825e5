#include "client_transport.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <memory>

namespace elasticstore {

namespace client_detail {

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns the message pointer (maybe not buf).
  const char* s = strerror_r(err, buf, sizeof buf);
  return s ? std::string(s) : std::string("errno ") + std::to_string(err);
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string fmt_seconds(double s) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f s", s);
  return buf;
}

std::string quote(std::string_view s) {
  constexpr std::size_t kMax = 96;
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size() && i < kMax; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > kMax) out += "...";
  out += '"';
  return out;
}

Clock::time_point deadline_after(Clock::time_point from, Timeout t) {
  // Negative, or so long that the clock arithmetic could overflow: no deadline.
  if (t.count() < 0 || t > std::chrono::hours(24 * 365 * 10)) return Clock::time_point::max();
  return from + t;
}

}  // namespace client_detail

namespace {

using namespace client_detail;
using std::chrono::milliseconds;

constexpr milliseconds kBackoffStart{10};
constexpr milliseconds kBackoffCap{1000};
// One connect() attempt to one address waits at most this long before the next is tried.
constexpr milliseconds kConnectAttemptCap{10'000};
// Keepalive detects a peer that vanished without a FIN during an infinite wait.
constexpr int kKeepIdleS = 30, kKeepIntervalS = 5, kKeepCount = 6;

}  // namespace

// ---- lifetime ---------------------------------------------------------------------------------

ClientTransport::ClientTransport(std::string host, uint16_t port,
                                 const std::function<bool()>& interrupt_check,
                                 const std::function<bool()>& interruptible,
                                 std::function<void()> on_close)
    : host_(std::move(host)),
      port_(port),
      interrupt_check_(interrupt_check),
      interruptible_(interruptible),
      on_close_(std::move(on_close)) {
  std::random_device rd;
  rng_.seed(rd());
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) throw NetworkError("eventfd: " + errno_text(errno));
}

ClientTransport::~ClientTransport() {
  if (fd_ >= 0) ::close(fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void ClientTransport::signal_close() {
  if (!closed_.exchange(true)) {
    const uint64_t one = 1;
    if (::write(wake_fd_, &one, sizeof one) < 0) {
      // Cannot fail for an eventfd counter this far from overflow; nothing to do if it did.
    }
  }
}

void ClientTransport::check_not_closed() const {
  if (closed_.load()) throw NetworkError(endpoint() + ": the client is closed");
}

std::string ClientTransport::endpoint() const {
  if (host_.find(':') != std::string::npos) return "[" + host_ + "]:" + std::to_string(port_);
  return host_ + ":" + std::to_string(port_);
}

void ClientTransport::close_fd() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  rlen_ = 0;
  consume_ = 0;
  on_close_();
}

void ClientTransport::fail_network(const std::string& what) {
  close_fd();
  throw NetworkError(endpoint() + ": " + what);
}

// ---- connecting -------------------------------------------------------------------------------

void ClientTransport::connect(Timeout timeout,
                              const std::function<void(Clock::time_point)>& handshake) {
  const auto start = Clock::now();
  const auto deadline = deadline_after(start, timeout);
  milliseconds delay = kBackoffStart;
  int attempts = 0;
  std::string last_error;
  for (;;) {
    check_not_closed();
    ++attempts;
    if (try_connect_once(deadline, &last_error)) {
      try {
        handshake(deadline);
        connected_once_ = true;
        return;
      } catch (const NetworkError& e) {  // e.g. a server at its connection limit: retry
        last_error = e.what();
        close_fd();
      }
    }
    check_not_closed();
    const auto now = Clock::now();
    if (now >= deadline) {
      const char* verb = connected_once_ ? "could not reconnect to " : "could not connect to ";
      throw NetworkError(verb + endpoint() + " within " +
                         fmt_seconds(seconds(now - start)) + " (" + std::to_string(attempts) +
                         (attempts == 1 ? " attempt" : " attempts") + "): " + last_error);
    }
    std::uniform_real_distribution<double> jitter(0.5, 1.0);
    auto sleep = std::chrono::duration_cast<Clock::duration>(delay * jitter(rng_));
    if (deadline != Clock::time_point::max()) sleep = std::min(sleep, deadline - now);
    wait_fd(0, now + sleep, "connecting", "");  // fd_ < 0: sleeps, honouring interrupts
    delay = std::min(delay * 2, kBackoffCap);
  }
}

bool ClientTransport::try_connect_once(Clock::time_point deadline, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_protocol = IPPROTO_TCP;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  const std::string service = std::to_string(port_);
  const char* node = host_.empty() ? nullptr : host_.c_str();
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(node, service.c_str(), &hints, &res);
  if (rc == EAI_NONAME && node) {
    hints.ai_flags = AI_NUMERICSERV;  // not a numeric address: forward lookup only
    rc = ::getaddrinfo(node, service.c_str(), &hints, &res);
  }
  if (rc != 0) {
    *error = "cannot resolve " + quote(host_) + ": " +
             (rc == EAI_SYSTEM ? errno_text(errno) : std::string(::gai_strerror(rc)));
    return false;
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> guard(res, ::freeaddrinfo);
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    const int s = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                           ai->ai_protocol);
    if (s < 0) {
      *error = "socket: " + errno_text(errno);
      continue;
    }
    fd_ = s;
    int err = 0;
    if (::connect(s, ai->ai_addr, ai->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS || err == EINTR) {
        // The last attempt, made at the deadline, still gets a short window to complete.
        const auto now = Clock::now();
        const auto attempt_deadline =
            std::max(std::min(deadline, now + kConnectAttemptCap), now + kLastAttemptWindow);
        if (!wait_fd(POLLOUT, attempt_deadline, "connecting", "")) {
          // Keep a more telling earlier error (e.g. refused) over a timeout cut by the deadline.
          if (!error->empty() && attempt_deadline < now + kConnectAttemptCap) {
            close_fd();
            continue;
          }
          err = ETIMEDOUT;
        } else {
          socklen_t len = sizeof err;
          if (::getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
        }
      }
    }
    if (err != 0) {
      *error = "connect: " + errno_text(err);
      close_fd();
      continue;
    }
    const int one = 1;
    ::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ::setsockopt(s, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    ::setsockopt(s, IPPROTO_TCP, TCP_KEEPIDLE, &kKeepIdleS, sizeof kKeepIdleS);
    ::setsockopt(s, IPPROTO_TCP, TCP_KEEPINTVL, &kKeepIntervalS, sizeof kKeepIntervalS);
    ::setsockopt(s, IPPROTO_TCP, TCP_KEEPCNT, &kKeepCount, sizeof kKeepCount);
    return true;
  }
  return false;
}

bool ClientTransport::idle_alive() {
  if (rlen_ > consume_) return false;  // unsolicited bytes: the stream is out of step
  char c;
  const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  return false;  // EOF (the server closed or restarted) or unsolicited data
}

// ---- waiting, sending, receiving ---------------------------------------------------------------

bool ClientTransport::wait_fd(short events, Clock::time_point deadline, const char* doing,
                              const char* what) {
  const bool check_interrupts = interrupt_check_ && (!interruptible_ || interruptible_());
  for (;;) {
    int timeout_ms = -1;
    if (deadline != Clock::time_point::max()) {
      const auto now = Clock::now();
      if (now >= deadline) return false;
      const auto rem = std::chrono::ceil<milliseconds>(deadline - now).count();
      timeout_ms = static_cast<int>(std::min<int64_t>(rem, INT_MAX));
    }
    if (check_interrupts) {
      timeout_ms = timeout_ms < 0 ? kInterruptPollMs : std::min(timeout_ms, kInterruptPollMs);
    }
    pollfd pfds[2] = {{wake_fd_, POLLIN, 0}, {fd_, events, 0}};
    const nfds_t nfds = fd_ >= 0 && events ? 2 : 1;
    const int n = ::poll(pfds, nfds, timeout_ms);
    if (n < 0 && errno != EINTR) fail_network(std::string("poll: ") + errno_text(errno));
    if (closed_.load()) {
      close_fd();
      throw NetworkError(endpoint() + ": the client was closed while " + doing +
                         (*what ? " " : "") + what);
    }
    // POLLERR/POLLHUP count as ready: the next send/recv reports the error.
    if (n > 0 && nfds == 2 && pfds[1].revents) return true;
    if (check_interrupts && interrupt_check_()) {
      close_fd();
      throw InterruptedError(endpoint() + ": interrupted while " + doing + (*what ? " " : "") +
                             what + "; connection closed");
    }
  }
}

void ClientTransport::send_all(const char* data, std::size_t size, Clock::time_point deadline,
                               const char* name) {
  std::size_t off = 0;
  while (off < size) {
    const ssize_t n = ::send(fd_, data + off, size - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      off += static_cast<std::size_t>(n);
      continue;
    }
    const int err = n < 0 ? errno : EPIPE;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      if (!wait_fd(POLLOUT, deadline, "sending", name)) {
        fail_network(std::string("timed out sending ") + name + " (" + std::to_string(off) +
                     " of " + std::to_string(size) + " bytes sent); connection closed");
      }
      continue;
    }
    fail_network("sending " + std::string(name) + ": " + errno_text(err) +
                 "; connection closed");
  }
}

void ClientTransport::drop_consumed() {
  if (consume_) {  // drop the previous reply
    rlen_ -= consume_;
    if (rlen_) std::memmove(&rbuf_[0], &rbuf_[consume_], rlen_);
    consume_ = 0;
  }
  if (rbuf_.size() > kKeepBufferBytes && rlen_ == 0) std::string().swap(rbuf_);
}

bool ClientTransport::receive(std::size_t want, Clock::time_point deadline, const char* name) {
  if (rbuf_.size() < want) rbuf_.resize(std::max(want, rbuf_.size() * 2));
  // A reply is rarely there the moment a request went out: wait first rather than spend a recv
  // on EAGAIN.
  if (!wait_fd(POLLIN, deadline, "waiting for the reply to", name)) return false;
  for (;;) {
    const ssize_t n = ::recv(fd_, &rbuf_[rlen_], rbuf_.size() - rlen_, MSG_DONTWAIT);
    if (n > 0) {
      rlen_ += static_cast<std::size_t>(n);
      return true;
    }
    if (n == 0) {
      fail_network(std::string("the server closed the connection while ") + name +
                   " was waiting for its reply");
    }
    const int err = errno;
    if (err == EINTR) continue;
    if (err != EAGAIN && err != EWOULDBLOCK) {
      fail_network(std::string("receiving the reply to ") + name + ": " + errno_text(err) +
                   "; connection closed");
    }
    if (!wait_fd(POLLIN, deadline, "waiting for the reply to", name)) return false;
  }
}

}  // namespace elasticstore
