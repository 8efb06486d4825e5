#include "client/transport.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "net/socket_options.hpp"

namespace elasticstore {

namespace {

using namespace client_detail;
using std::chrono::milliseconds;

constexpr milliseconds kBackoffStart{10};
constexpr milliseconds kBackoffCap{1000};
// One connect() attempt to one address waits at most this long before the next is tried: the
// first kConnectAttemptFirst, each next one twice as long, up to kConnectAttemptCap. A SYN lost
// on a lossy link is sent again by the kernel only after its 1 s retransmission timeout, which
// would spend a whole short budget (a 1 s reconnect): a new attempt sends a new SYN sooner.
constexpr milliseconds kConnectAttemptFirst{250};
constexpr milliseconds kConnectAttemptCap{10'000};
// Keepalive detects a peer that vanished without a FIN during an infinite wait.
constexpr KeepaliveOptions kKeepalive{30, 5, 6, 0};

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
  fork_gen_ = fork_generation();  // counts fork()s from the first client on
  rng_.seed(random_seed());
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) throw NetworkError("eventfd: " + errno_text(errno));
}

ClientTransport::~ClientTransport() {
  if (fd_ >= 0) ::close(fd_);  // never shutdown(): after fork() the parent may share it
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void ClientTransport::signal_close() {
  if (!closed_.exchange(true)) {
    // After fork() the eventfd is the parent's too: waking it would disturb the parent's calls.
    // No call of this process can be waiting on it (the first call here replaces it).
    if (inherited()) return;
    const uint64_t one = 1;
    if (::write(wake_fd_, &one, sizeof one) < 0) {
      // Cannot fail for an eventfd counter this far from overflow; nothing to do if it did.
    }
  }
}

void ClientTransport::drop_inherited() {
  if (fd_ >= 0) {
    ::close(fd_);  // no shutdown(), no send: the parent's connection and session are untouched
    fd_ = -1;
  }
  rlen_ = 0;
  consume_ = 0;
  resolving_.reset();  // its thread stayed in the parent
  const int fresh = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fresh < 0) throw NetworkError(endpoint() + ": eventfd: " + errno_text(errno));
  ::close(wake_fd_.exchange(fresh));
  fork_gen_ = fork_generation();
  on_close_();
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
  milliseconds attempt_cap = kConnectAttemptFirst;
  int attempts = 0;
  std::string last_error;
  for (;;) {
    check_not_closed();
    ++attempts;
    const bool connected = try_connect_once(deadline, attempt_cap, &last_error);
    attempt_cap = std::min(attempt_cap * 2, kConnectAttemptCap);
    if (connected) {
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
                         fmt_seconds(seconds(now - start)) + " (timeout; " + std::to_string(attempts) +
                         (attempts == 1 ? " attempt" : " attempts") + "): " + last_error);
    }
    std::uniform_real_distribution<double> jitter(0.5, 1.0);
    auto sleep = std::chrono::duration_cast<Clock::duration>(delay * jitter(rng_));
    if (deadline != Clock::time_point::max()) sleep = std::min(sleep, deadline - now);
    wait_fd(0, now + sleep, "connecting", "");  // fd_ < 0: sleeps, honouring interrupts
    delay = std::min(delay * 2, kBackoffCap);
  }
}

std::shared_ptr<ResolveJob> ClientTransport::resolve(Clock::time_point deadline,
                                                     std::string* error) {
  const std::string service = std::to_string(port_);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_protocol = IPPROTO_TCP;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  const char* node = host_.empty() ? nullptr : host_.c_str();
  auto job = std::make_shared<ResolveJob>();
  job->rc = ::getaddrinfo(node, service.c_str(), &hints, &job->res);  // numeric: no I/O
  job->err = errno;
  if (job->rc == EAI_NONAME && node) {
    // A name: a forward lookup on a thread (a lookup still running from an earlier attempt is
    // waited for rather than started again), bounded by the deadline.
    if (!resolving_) {
      hints.ai_flags = AI_NUMERICSERV;  // no AI_CANONNAME: never a reverse lookup
      resolving_ = start_lookup(host_, service, hints);
    }
    job = resolving_;
    const bool check_interrupts = interrupt_check_ && (!interruptible_ || interruptible_());
    std::unique_lock<std::mutex> lock(job->mu);
    while (!job->done) {
      check_not_closed();
      const auto now = Clock::now();
      if (now >= deadline) {
        *error = "cannot resolve " + quote(host_) + ": no answer from the resolver in time";
        return nullptr;
      }
      auto until = deadline;
      if (check_interrupts) until = std::min(until, now + milliseconds(kInterruptPollMs));
      job->cv.wait_until(lock, until);
      if (!job->done && check_interrupts) {
        lock.unlock();
        if (interrupt_check_()) {
          throw InterruptedError(endpoint() + ": interrupted while resolving " + quote(host_));
        }
        lock.lock();
      }
    }
    resolving_.reset();
  }
  if (job->rc != 0) {
    *error = "cannot resolve " + quote(host_) + ": " +
             (job->rc == EAI_SYSTEM ? errno_text(job->err) : std::string(::gai_strerror(job->rc)));
    return nullptr;
  }
  return job;
}

bool ClientTransport::try_connect_once(Clock::time_point deadline, milliseconds attempt_cap,
                                       std::string* error) {
  const std::shared_ptr<ResolveJob> resolved = resolve(deadline, error);
  if (!resolved) return false;
  addrinfo* res = resolved->res;
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
            std::max(std::min(deadline, now + attempt_cap), now + kLastAttemptWindow);
        if (!wait_fd(POLLOUT, attempt_deadline, "connecting", "")) {
          // Keep a more telling earlier error (e.g. refused) over a timeout cut by the deadline.
          if (!error->empty() && attempt_deadline < now + attempt_cap) {
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
    // Blocking from now on: recv() blocks for at most kRecvSlice (SO_RCVTIMEO), send() is made
    // non-blocking per call (MSG_DONTWAIT).
    const int flags = ::fcntl(s, F_GETFL);
    if (flags < 0 || ::fcntl(s, F_SETFL, flags & ~O_NONBLOCK) != 0) {
      *error = "fcntl: " + errno_text(errno);
      close_fd();
      continue;
    }
    const timeval slice{0, static_cast<suseconds_t>(kRecvSlice.count() * 1000)};
    ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &slice, sizeof slice);
    set_nodelay(s);  // best effort, as keepalive: the connection works without either
    set_keepalive(s, kKeepalive);
    last_used_ = Clock::now();
    return true;
  }
  return false;
}

bool ClientTransport::idle_alive() {
  if (rlen_ > consume_) return false;  // unsolicited bytes: the stream is out of step
  // Used a moment ago: skip the peek (a syscall). A server that went away since is noticed by
  // this call's send or recv instead (a NetworkError; the request is not sent again).
  if (Clock::now() - last_used_ < kIdleCheck) return true;
  char c;
  const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  return false;  // EOF (the server closed or restarted) or unsolicited data
}

// ---- waiting, sending, receiving ---------------------------------------------------------------

void ClientTransport::check_not_closed_waiting(const char* doing, const char* what) {
  if (closed_.load()) {
    close_fd();
    throw NetworkError(endpoint() + ": the client was closed while " + doing +
                       (*what ? " " : "") + what);
  }
}

bool ClientTransport::wait_fd(short events, Clock::time_point deadline, const char* doing,
                              const char* what, bool stalled) {
  const bool check_interrupts = interrupt_check_ && (!interruptible_ || interruptible_());
  bool last_look = false, stall_granted = false;  // a poll past the deadline; kStallGrace added
  for (;;) {
    int timeout_ms = -1;
    Clock::time_point now{};  // read only when there is a deadline: the stall check's start
    if (deadline != Clock::time_point::max()) {
      now = Clock::now();
      if (now >= deadline && stalled && !stall_granted && fd_ >= 0 && events) {
        stall_granted = true;  // this process did not run for a while: the server may not
        deadline = now + kStallGrace;  // have either (it ran in this process, or starved too)
      } else if (now >= deadline) {
        if (last_look || fd_ < 0 || !events) return false;
        last_look = true;
      }
      const auto rem = std::chrono::ceil<milliseconds>(deadline - now).count();
      timeout_ms = last_look ? 0 : static_cast<int>(std::min<int64_t>(rem, INT_MAX));
    }
    if (check_interrupts) {
      timeout_ms = timeout_ms < 0 ? kInterruptPollMs : std::min(timeout_ms, kInterruptPollMs);
    }
    check_not_closed_waiting(doing, what);
    pollfd pfds[2] = {{wake_fd_.load(), POLLIN, 0}, {fd_, events, 0}};
    const nfds_t nfds = fd_ >= 0 && events ? 2 : 1;
    const int n = ::poll(pfds, nfds, timeout_ms);
    if (n < 0 && errno != EINTR) fail_network(std::string("poll: ") + errno_text(errno));
    if (nfds == 2 && timeout_ms >= 0 && deadline != Clock::time_point::max()) {
      stalled = stalled || Clock::now() - now > milliseconds(timeout_ms) + kStallTolerance;
    }
    check_not_closed_waiting(doing, what);
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
        fail_network(std::string("timeout sending ") + name + " (" + std::to_string(off) +
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
  // One recv: true when bytes came, false when none yet (slice, EAGAIN, signal); EOF/errors throw.
  auto take = [&](int flags) {
    const ssize_t n = ::recv(fd_, &rbuf_[rlen_], rbuf_.size() - rlen_, flags);
    if (n > 0) {
      rlen_ += static_cast<std::size_t>(n);
      last_used_ = Clock::now();
      return true;
    }
    if (n == 0) eof_while(name);
    const int err = errno;
    if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR) recv_failed(name, err);
    return false;
  };
  // Fast path: one blocking recv, cut after kRecvSlice by the socket's receive timeout (a reply
  // to a request that does not block server-side is nearly always there by then); else poll(),
  // which watches close() and interrupts too. stalled: the recv returned far later (kStallGrace).
  bool stalled = false;
  if (const auto asked = Clock::now(); deadline - asked >= kRecvSlice) {
    if (take(0)) return true;
    stalled = Clock::now() - asked > kRecvSlice + kStallTolerance;
  }
  for (;;) {
    if (!wait_fd(POLLIN, deadline, "waiting for the reply to", name, stalled)) return false;
    if (take(MSG_DONTWAIT)) return true;
  }
}

void ClientTransport::eof_while(const char* name) {
  fail_network(std::string("the server closed the connection while ") + name +
               " was waiting for its reply");
}

void ClientTransport::recv_failed(const char* name, int err) {
  fail_network(std::string("receiving the reply to ") + name + ": " + errno_text(err) +
               "; connection closed");
}

}  // namespace elasticstore
