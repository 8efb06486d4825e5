#include "client.hpp"

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

namespace elasticstore {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Requests that never block server-side carry no timeout; their reply deadline is op_timeout.
constexpr uint32_t kNotBlocking = 0;
// The client waits for a blocking request's reply until the server timeout plus this slack.
constexpr milliseconds kMinSlack{2000};
// A reply frame larger than this is a protocol error (no allocation trusts a declared length).
constexpr std::size_t kMaxReplyFrameBytes = kMaxReplyBytes + kMaxFrameBytes;
// Reply fields are bounded by the frame; the server enforces the real limits.
constexpr std::size_t kMaxReplyField = kMaxReplyFrameBytes;
constexpr std::size_t kReadChunk = 64 * 1024;
// Buffers grown past this by a large request or reply are released afterwards.
constexpr std::size_t kKeepBufferBytes = 1024 * 1024;
constexpr milliseconds kBackoffStart{10};
constexpr milliseconds kBackoffCap{1000};
// One connect() attempt to one address waits at most this long before the next is tried.
constexpr milliseconds kConnectAttemptCap{10'000};
constexpr milliseconds kLastAttemptWindow{100};
// Keepalive detects a peer that vanished without a FIN during an infinite wait.
constexpr int kKeepIdleS = 30, kKeepIntervalS = 5, kKeepCount = 6;

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

std::string lower_op(Op op) {
  std::string s = op_name(static_cast<uint8_t>(op));
  for (char& c : s) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return s;
}

// A key for a message: quoted, non-printable bytes escaped, long keys cut.
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

template <typename Seq>
std::string quote_list(const Seq& keys) {
  constexpr std::size_t kMax = 8;
  std::string out = "[";
  std::size_t i = 0;
  for (const auto& k : keys) {
    if (i == kMax) {
      out += ", ... (" + std::to_string(keys.size() - kMax) + " more)";
      break;
    }
    if (i++) out += ", ";
    out += quote(k);
  }
  out += ']';
  return out;
}

uint32_t wire_timeout(Timeout t) {
  if (t.count() < 0) return kNoTimeout;
  if (static_cast<uint64_t>(t.count()) >= kNoTimeout) return kNoTimeout - 1;  // clamp (~49 days)
  return static_cast<uint32_t>(t.count());
}

// The shorter of two timeouts, negative meaning none.
Timeout min_timeout(Timeout a, Timeout b) {
  if (a.count() < 0) return b;
  if (b.count() < 0) return a;
  return std::min(a, b);
}

Clock::time_point deadline_after(Clock::time_point from, Timeout t) {
  // Negative, or so long that the clock arithmetic could overflow: no deadline.
  if (t.count() < 0 || t > std::chrono::hours(24 * 365 * 10)) return Clock::time_point::max();
  return from + t;
}

void check_key(Op op, std::string_view key) {
  if (key.size() > kMaxKeyBytes) {
    throw StoreError(lower_op(op) + ": key of " + std::to_string(key.size()) +
                     " bytes exceeds the limit of " + std::to_string(kMaxKeyBytes) + " bytes");
  }
}

void check_value(Op op, std::string_view key, std::string_view value) {
  if (value.size() > kMaxValueBytes) {
    throw StoreError(lower_op(op) + " " + quote(key) + ": value of " +
                     std::to_string(value.size()) + " bytes exceeds the limit of " +
                     std::to_string(kMaxValueBytes) + " bytes");
  }
}

void check_keys(Op op, const std::vector<std::string>& keys) {
  if (keys.size() > kMaxKeysPerRequest) {
    throw StoreError(lower_op(op) + ": " + std::to_string(keys.size()) +
                     " keys exceed the limit of " + std::to_string(kMaxKeysPerRequest) +
                     " keys per request");
  }
  for (const auto& k : keys) check_key(op, k);
}

void read_keys(Reader& rd, std::vector<std::string>* out) {
  const uint32_t n = rd.count(kMaxKeysPerRequest, 4);
  out->reserve(n);
  for (uint32_t i = 0; i < n && rd.ok(); ++i) out->emplace_back(rd.bytes(kMaxReplyField));
}

}  // namespace

// ---- lifetime ---------------------------------------------------------------------------------

Client::Client(std::string host, uint16_t port, ClientOptions options)
    : host_(std::move(host)), port_(port), options_(std::move(options)) {
  if (host_.size() >= 2 && host_.front() == '[' && host_.back() == ']') {
    host_ = host_.substr(1, host_.size() - 2);  // "[::1]" -> "::1"
  }
  if (options_.client_name.size() > kMaxClientNameBytes) {
    throw StoreError("client name of " + std::to_string(options_.client_name.size()) +
                     " bytes exceeds the limit of " + std::to_string(kMaxClientNameBytes) +
                     " bytes");
  }
  std::random_device rd;
  rng_.seed(rd());
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) throw NetworkError("eventfd: " + errno_text(errno));
  try {
    std::lock_guard<std::timed_mutex> lock(mu_);
    connect_locked(options_.connect_timeout);
  } catch (...) {
    if (fd_ >= 0) ::close(fd_);
    ::close(wake_fd_);
    throw;
  }
}

Client::~Client() {
  if (fd_ >= 0) ::close(fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

bool Client::connected() const { return connected_.load(std::memory_order_relaxed); }

std::unique_ptr<Client> Client::clone() const {
  check_not_closed();
  return std::make_unique<Client>(host_, port_, options_);
}

void Client::close() {
  if (!closed_.exchange(true)) {
    const uint64_t one = 1;
    if (::write(wake_fd_, &one, sizeof one) < 0) {
      // Cannot fail for an eventfd counter this far from overflow; nothing to do if it did.
    }
  }
  std::lock_guard<std::timed_mutex> lock(mu_);  // waits for a call in progress to notice
  close_fd_locked();
}

std::unique_lock<std::timed_mutex> Client::lock_call() {
  std::unique_lock<std::timed_mutex> lock(mu_, std::defer_lock);
  if (lock.try_lock()) return lock;
  const milliseconds poll = options_.interrupt_check ? milliseconds(kInterruptPollMs)
                                                     : milliseconds(1000);
  for (;;) {
    check_not_closed();
    if (lock.try_lock_for(poll)) return lock;
    if (options_.interrupt_check && options_.interrupt_check()) {
      throw InterruptedError(endpoint() + ": interrupted while waiting for another thread's " +
                             "call on this client");
    }
  }
}

void Client::check_not_closed() const {
  if (closed_.load()) throw NetworkError(endpoint() + ": the client is closed");
}

std::string Client::endpoint() const {
  if (host_.find(':') != std::string::npos) return "[" + host_ + "]:" + std::to_string(port_);
  return host_ + ":" + std::to_string(port_);
}

void Client::close_fd_locked() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  connected_ = false;
  session_id_ = 0;
  rlen_ = 0;
  consume_ = 0;
}

void Client::fail_network_locked(const std::string& what) {
  close_fd_locked();
  throw NetworkError(endpoint() + ": " + what);
}

void Client::fail_protocol_locked(const std::string& what) {
  close_fd_locked();
  throw ProtocolError(endpoint() + ": protocol error: " + what + "; connection closed");
}

// ---- connecting -------------------------------------------------------------------------------

void Client::connect_locked(Timeout timeout) {
  const auto start = Clock::now();
  const auto deadline = deadline_after(start, timeout);
  milliseconds delay = kBackoffStart;
  int attempts = 0;
  std::string last_error;
  for (;;) {
    check_not_closed();
    ++attempts;
    if (try_connect_once_locked(deadline, &last_error)) {
      try {
        handshake_locked(deadline);
        return;
      } catch (const NetworkError& e) {  // e.g. a server at its connection limit: retry
        last_error = e.what();
        close_fd_locked();
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
    wait_fd_locked(0, now + sleep, "connecting", "");  // fd_ < 0: sleeps, honouring interrupts
    delay = std::min(delay * 2, kBackoffCap);
  }
}

bool Client::try_connect_once_locked(Clock::time_point deadline, std::string* error) {
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
        if (!wait_fd_locked(POLLOUT, attempt_deadline, "connecting", "")) {
          // Keep a more telling earlier error (e.g. refused) over a timeout cut by the deadline.
          if (!error->empty() && attempt_deadline < now + kConnectAttemptCap) {
            close_fd_locked();
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
      close_fd_locked();
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

void Client::handshake_locked(Clock::time_point deadline) {
  // A server that accepts but never answers must not stall the retries forever; a connection
  // made in the last attempt's window still gets a short window for the handshake.
  const auto now = Clock::now();
  if (options_.op_timeout.count() >= 0) deadline = std::min(deadline, now + options_.op_timeout);
  deadline = std::max(deadline, now + kLastAttemptWindow);
  wbuf_.clear();
  wbuf_.append(kNativePreamble, kPreambleBytes);
  Writer w(wbuf_);
  const uint32_t id = next_request_id_++;
  w.begin_frame(static_cast<uint8_t>(Op::Hello), id);
  w.u32(kProtocolVersion);
  w.bytes(options_.client_name);
  w.end_frame();
  send_all_locked(wbuf_.data(), wbuf_.size(), deadline, Op::Hello);
  const Reply r = read_reply_locked(id, deadline, Op::Hello, kNotBlocking, Clock::now());
  if (r.status != static_cast<uint8_t>(Status::Ok)) {
    Reader rd(r.payload);
    const std::string msg(rd.bytes(kMaxReplyField));
    close_fd_locked();
    throw StoreError("connecting to " + endpoint() + ": the server refused the session (" +
                     status_name(r.status) + "): " + msg);
  }
  Reader rd(r.payload);
  const uint32_t version = rd.u32();
  const uint64_t session = rd.u64();
  finish_locked(rd, Op::Hello);
  if (version != kProtocolVersion) {
    close_fd_locked();
    throw StoreError("connecting to " + endpoint() + ": the server speaks protocol version " +
                     std::to_string(version) + ", this client " +
                     std::to_string(kProtocolVersion));
  }
  session_id_ = session;
  connected_ = true;
  connected_once_ = true;
}

bool Client::idle_connection_alive_locked() {
  if (rlen_ > consume_) return false;  // unsolicited bytes: the stream is out of step
  char c;
  const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  return false;  // EOF (the server closed or restarted) or unsolicited data
}

void Client::ensure_connected_locked() {
  check_not_closed();
  // Nothing of a new request was sent yet, so reconnecting here is always safe.
  if (fd_ >= 0 && !idle_connection_alive_locked()) close_fd_locked();
  if (fd_ < 0) {
    connect_locked(min_timeout(options_.reconnect_timeout, options_.connect_timeout));
  }
}

// ---- one exchange -----------------------------------------------------------------------------

Writer Client::begin_locked(Op op) {
  (void)op;
  ensure_connected_locked();
  if (consume_) {  // drop the previous reply
    rlen_ -= consume_;
    if (rlen_) std::memmove(&rbuf_[0], &rbuf_[consume_], rlen_);
    consume_ = 0;
  }
  if (rbuf_.size() > kKeepBufferBytes && rlen_ == 0) std::string().swap(rbuf_);
  if (wbuf_.capacity() > kKeepBufferBytes) std::string().swap(wbuf_);
  wbuf_.clear();
  Writer w(wbuf_);
  request_id_ = next_request_id_++;
  w.begin_frame(static_cast<uint8_t>(op), request_id_);
  return w;
}

Client::Reply Client::exchange_locked(Writer& w, Op op, uint32_t server_timeout_ms) {
  w.end_frame();
  if (wbuf_.size() - 4 > kMaxFrameBytes) {
    throw StoreError(lower_op(op) + ": the request of " + std::to_string(wbuf_.size()) +
                     " bytes exceeds the frame limit of " + std::to_string(kMaxFrameBytes) +
                     " bytes");
  }
  send_all_locked(wbuf_.data(), wbuf_.size(), deadline_after(Clock::now(), options_.op_timeout),
                  op);
  const auto sent_at = Clock::now();
  Clock::time_point deadline;
  if (server_timeout_ms == kNotBlocking) {
    deadline = deadline_after(sent_at, options_.op_timeout);
  } else if (server_timeout_ms == kNoTimeout) {
    deadline = Clock::time_point::max();
  } else {
    const milliseconds t(server_timeout_ms);
    deadline = sent_at + t + std::max(kMinSlack, t / 10);
  }
  return read_reply_locked(request_id_, deadline, op, server_timeout_ms, sent_at);
}

bool Client::wait_fd_locked(short events, Clock::time_point deadline, const char* doing,
                            const char* what) {
  for (;;) {
    int timeout_ms = -1;
    if (deadline != Clock::time_point::max()) {
      const auto now = Clock::now();
      if (now >= deadline) return false;
      const auto rem = std::chrono::ceil<milliseconds>(deadline - now).count();
      timeout_ms = static_cast<int>(std::min<int64_t>(rem, INT_MAX));
    }
    if (options_.interrupt_check) {
      timeout_ms = timeout_ms < 0 ? kInterruptPollMs : std::min(timeout_ms, kInterruptPollMs);
    }
    pollfd pfds[2] = {{wake_fd_, POLLIN, 0}, {fd_, events, 0}};
    const nfds_t nfds = fd_ >= 0 && events ? 2 : 1;
    const int n = ::poll(pfds, nfds, timeout_ms);
    if (n < 0 && errno != EINTR) fail_network_locked(std::string("poll: ") + errno_text(errno));
    if (closed_.load()) {
      close_fd_locked();
      throw NetworkError(endpoint() + ": the client was closed while " + doing +
                         (*what ? " " : "") + what);
    }
    // POLLERR/POLLHUP count as ready: the next send/recv reports the error.
    if (n > 0 && nfds == 2 && pfds[1].revents) return true;
    if (options_.interrupt_check && options_.interrupt_check()) {
      close_fd_locked();
      throw InterruptedError(endpoint() + ": interrupted while " + doing + (*what ? " " : "") +
                             what + "; connection closed");
    }
  }
}

void Client::send_all_locked(const char* data, std::size_t size, Clock::time_point deadline,
                             Op op) {
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
      const char* name = op_name(static_cast<uint8_t>(op));
      if (!wait_fd_locked(POLLOUT, deadline, "sending", name)) {
        fail_network_locked(std::string("timed out sending ") + name + " (" +
                            std::to_string(off) + " of " +
                            std::to_string(size) + " bytes sent); connection closed");
      }
      continue;
    }
    fail_network_locked("sending " + std::string(op_name(static_cast<uint8_t>(op))) + ": " +
                        errno_text(err) + "; connection closed");
  }
}

Client::Reply Client::read_reply_locked(uint32_t request_id, Clock::time_point deadline, Op op,
                                        uint32_t server_timeout_ms, Clock::time_point sent_at) {
  const char* name = op_name(static_cast<uint8_t>(op));
  for (;;) {
    FrameHeader h;
    const FrameParse st = peek_frame(rbuf_.data(), rlen_, kMaxReplyFrameBytes, &h);
    if (st == FrameParse::Ready) {
      if (h.request_id != request_id) {
        fail_protocol_locked("reply to request " + std::to_string(h.request_id) +
                             " while waiting for request " + std::to_string(request_id) + " (" +
                             std::string(name) + ")");
      }
      consume_ = h.total();
      return Reply{h.code, std::string_view(rbuf_.data() + kFrameHeaderBytes, h.payload_len())};
    }
    if (st == FrameParse::TooLarge) {
      fail_protocol_locked(std::string("reply frame to ") + name + " too large");
    }
    if (st == FrameParse::Malformed) {
      fail_protocol_locked(std::string("malformed reply frame to ") + name);
    }
    std::size_t want = rlen_ + kReadChunk;
    if (rlen_ >= 4) {
      uint32_t body = 0;
      std::memcpy(&body, rbuf_.data(), 4);
      want = std::max(want, 4 + static_cast<std::size_t>(body));
    }
    if (rbuf_.size() < want) rbuf_.resize(std::max(want, rbuf_.size() * 2));
    const ssize_t n = ::recv(fd_, &rbuf_[rlen_], rbuf_.size() - rlen_, MSG_DONTWAIT);
    if (n > 0) {
      rlen_ += static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0) {
      fail_network_locked(std::string("the server closed the connection while ") + name +
                          " was waiting for its reply");
    }
    const int err = errno;
    if (err == EINTR) continue;
    if (err != EAGAIN && err != EWOULDBLOCK) {
      fail_network_locked(std::string("receiving the reply to ") + name + ": " +
                          errno_text(err) + "; connection closed");
    }
    if (!wait_fd_locked(POLLIN, deadline, "waiting for the reply to", name)) {
      std::string what = std::string("no reply to ") + name + " within " +
                         fmt_seconds(seconds(Clock::now() - sent_at));
      if (server_timeout_ms != kNotBlocking && server_timeout_ms != kNoTimeout) {
        what += " (server timeout " + fmt_seconds(server_timeout_ms / 1000.0) + ")";
      }
      fail_network_locked(what + "; connection closed");
    }
  }
}

void Client::fail_status_locked(const Reply& r, Op op, const std::string& subject) {
  switch (static_cast<Status>(r.status)) {
    case Status::Error:
    case Status::WrongType:
    case Status::TooLarge:
    case Status::Unauthenticated: {
      Reader rd(r.payload);
      const std::string msg(rd.bytes(kMaxReplyField));
      finish_locked(rd, op);
      throw StoreError(lower_op(op) + (subject.empty() ? "" : " " + subject) + ": " + msg);
    }
    default:
      fail_protocol_locked(std::string("unexpected status ") + status_name(r.status) +
                           " in the reply to " + op_name(static_cast<uint8_t>(op)));
  }
}

void Client::finish_locked(const Reader& rd, Op op) {
  if (!rd.done()) {
    fail_protocol_locked(std::string("malformed reply to ") + op_name(static_cast<uint8_t>(op)));
  }
}

// ---- operations -------------------------------------------------------------------------------

uint64_t Client::set(std::string_view key, std::string_view value, bool ephemeral) {
  check_key(Op::Set, key);
  check_value(Op::Set, key, value);
  auto lock = lock_call();
  Writer w = begin_locked(Op::Set);
  w.bytes(key);
  w.bytes(value);
  w.u8(ephemeral ? kFlagEphemeral : 0);
  const Reply r = exchange_locked(w, Op::Set, kNotBlocking);
  expect_ok_locked(r, Op::Set, [&] { return quote(key); });
  Reader rd(r.payload);
  const uint64_t revision = rd.u64();
  finish_locked(rd, Op::Set);
  return revision;
}

std::string Client::get(std::string_view key, Timeout timeout) {
  check_key(Op::Get, key);
  auto lock = lock_call();
  const uint32_t t = wire_timeout(timeout);
  Writer w = begin_locked(Op::Get);
  w.bytes(key);
  w.u32(t);
  const auto start = Clock::now();
  const Reply r = exchange_locked(w, Op::Get, t);
  Reader rd(r.payload);
  if (r.status == static_cast<uint8_t>(Status::Timeout)) {
    finish_locked(rd, Op::Get);
    throw TimeoutError("get timed out after " + fmt_seconds(seconds(Clock::now() - start)) +
                       " waiting for key " + quote(key));
  }
  expect_ok_locked(r, Op::Get, [&] { return quote(key); });
  std::string value(rd.bytes(kMaxReplyField));
  rd.u64();  // mod_revision
  finish_locked(rd, Op::Get);
  return value;
}

std::optional<std::pair<std::string, uint64_t>> Client::try_get(std::string_view key) {
  check_key(Op::TryGet, key);
  auto lock = lock_call();
  Writer w = begin_locked(Op::TryGet);
  w.bytes(key);
  const Reply r = exchange_locked(w, Op::TryGet, kNotBlocking);
  expect_ok_locked(r, Op::TryGet, [&] { return quote(key); });
  Reader rd(r.payload);
  const bool found = rd.u8() != 0;
  std::string value(rd.bytes(kMaxReplyField));
  const uint64_t revision = rd.u64();
  finish_locked(rd, Op::TryGet);
  if (!found) return std::nullopt;
  return std::make_pair(std::move(value), revision);
}

int64_t Client::add(std::string_view key, int64_t delta) {
  check_key(Op::Add, key);
  auto lock = lock_call();
  Writer w = begin_locked(Op::Add);
  w.bytes(key);
  w.i64(delta);
  const Reply r = exchange_locked(w, Op::Add, kNotBlocking);
  expect_ok_locked(r, Op::Add, [&] { return quote(key); });
  Reader rd(r.payload);
  const int64_t v = rd.i64();
  finish_locked(rd, Op::Add);
  return v;
}

CompareSetResult Client::compare_set(std::string_view key, std::string_view expected,
                                     std::string_view desired, bool ephemeral) {
  check_key(Op::CompareSet, key);
  check_value(Op::CompareSet, key, expected);
  check_value(Op::CompareSet, key, desired);
  auto lock = lock_call();
  Writer w = begin_locked(Op::CompareSet);
  w.bytes(key);
  w.bytes(expected);
  w.bytes(desired);
  w.u8(ephemeral ? kFlagEphemeral : 0);
  const Reply r = exchange_locked(w, Op::CompareSet, kNotBlocking);
  expect_ok_locked(r, Op::CompareSet, [&] { return quote(key); });
  Reader rd(r.payload);
  CompareSetResult out;
  out.swapped = rd.u8() != 0;
  out.exists = rd.u8() != 0;
  out.current = std::string(rd.bytes(kMaxReplyField));
  finish_locked(rd, Op::CompareSet);
  return out;
}

void Client::wait(const std::vector<std::string>& keys, Timeout timeout) {
  check_keys(Op::Wait, keys);
  if (keys.empty()) {
    check_not_closed();
    return;
  }
  auto lock = lock_call();
  const uint32_t t = wire_timeout(timeout);
  Writer w = begin_locked(Op::Wait);
  w.keys(keys);
  w.u32(t);
  const auto start = Clock::now();
  const Reply r = exchange_locked(w, Op::Wait, t);
  Reader rd(r.payload);
  if (r.status == static_cast<uint8_t>(Status::Timeout)) {
    std::vector<std::string> missing;
    read_keys(rd, &missing);
    finish_locked(rd, Op::Wait);
    throw TimeoutError("wait timed out after " + fmt_seconds(seconds(Clock::now() - start)) +
                       " for keys " + quote_list(keys) + " (missing: " + quote_list(missing) +
                       ")");
  }
  expect_ok_locked(r, Op::Wait, [&] { return quote_list(keys); });
  finish_locked(rd, Op::Wait);
}

bool Client::check(const std::vector<std::string>& keys) {
  check_keys(Op::Check, keys);
  if (keys.empty()) {
    check_not_closed();
    return true;
  }
  auto lock = lock_call();
  Writer w = begin_locked(Op::Check);
  w.keys(keys);
  const Reply r = exchange_locked(w, Op::Check, kNotBlocking);
  expect_ok_locked(r, Op::Check, [&] { return quote_list(keys); });
  Reader rd(r.payload);
  const bool all = rd.u8() != 0;
  finish_locked(rd, Op::Check);
  return all;
}

bool Client::delete_key(std::string_view key) {
  check_key(Op::DeleteKey, key);
  auto lock = lock_call();
  Writer w = begin_locked(Op::DeleteKey);
  w.bytes(key);
  const Reply r = exchange_locked(w, Op::DeleteKey, kNotBlocking);
  expect_ok_locked(r, Op::DeleteKey, [&] { return quote(key); });
  Reader rd(r.payload);
  const bool deleted = rd.u8() != 0;
  finish_locked(rd, Op::DeleteKey);
  return deleted;
}

int64_t Client::num_keys() {
  auto lock = lock_call();
  Writer w = begin_locked(Op::NumKeys);
  const Reply r = exchange_locked(w, Op::NumKeys, kNotBlocking);
  expect_ok_locked(r, Op::NumKeys, [] { return std::string(); });
  Reader rd(r.payload);
  const int64_t n = rd.i64();
  finish_locked(rd, Op::NumKeys);
  return n;
}

std::vector<std::string> Client::list_keys(std::string_view prefix) {
  check_key(Op::ListKeys, prefix);
  auto lock = lock_call();
  Writer w = begin_locked(Op::ListKeys);
  w.bytes(prefix);
  const Reply r = exchange_locked(w, Op::ListKeys, kNotBlocking);
  expect_ok_locked(r, Op::ListKeys, [&] { return "prefix " + quote(prefix); });
  Reader rd(r.payload);
  std::vector<std::string> keys;
  // The listing is bounded by the reply size, not by kMaxKeysPerRequest.
  const uint32_t n = rd.count(UINT32_MAX, 4);
  keys.reserve(n);
  for (uint32_t i = 0; i < n && rd.ok(); ++i) keys.emplace_back(rd.bytes(kMaxReplyField));
  finish_locked(rd, Op::ListKeys);
  return keys;
}

uint64_t Client::append(std::string_view key, std::string_view value) {
  check_key(Op::Append, key);
  check_value(Op::Append, key, value);
  auto lock = lock_call();
  Writer w = begin_locked(Op::Append);
  w.bytes(key);
  w.bytes(value);
  const Reply r = exchange_locked(w, Op::Append, kNotBlocking);
  expect_ok_locked(r, Op::Append, [&] { return quote(key); });
  Reader rd(r.payload);
  const uint64_t revision = rd.u64();
  finish_locked(rd, Op::Append);
  return revision;
}

std::vector<std::string> Client::multi_get(const std::vector<std::string>& keys,
                                           Timeout timeout) {
  check_keys(Op::MultiGet, keys);
  if (keys.empty()) {
    check_not_closed();
    return {};
  }
  auto lock = lock_call();
  const uint32_t t = wire_timeout(timeout);
  Writer w = begin_locked(Op::MultiGet);
  w.keys(keys);
  w.u32(t);
  const auto start = Clock::now();
  const Reply r = exchange_locked(w, Op::MultiGet, t);
  Reader rd(r.payload);
  if (r.status == static_cast<uint8_t>(Status::Timeout)) {
    std::vector<std::string> missing;
    read_keys(rd, &missing);
    finish_locked(rd, Op::MultiGet);
    throw TimeoutError("multi_get timed out after " +
                       fmt_seconds(seconds(Clock::now() - start)) + " for keys " +
                       quote_list(keys) + " (missing: " + quote_list(missing) + ")");
  }
  expect_ok_locked(r, Op::MultiGet, [&] { return quote_list(keys); });
  const uint32_t n = rd.count(kMaxKeysPerRequest, 4);
  std::vector<std::string> values;
  values.reserve(n);
  for (uint32_t i = 0; i < n && rd.ok(); ++i) values.emplace_back(rd.bytes(kMaxReplyField));
  finish_locked(rd, Op::MultiGet);
  if (values.size() != keys.size()) {
    fail_protocol_locked("MULTI_GET returned " + std::to_string(values.size()) +
                         " values for " + std::to_string(keys.size()) + " keys");
  }
  return values;
}

uint64_t Client::multi_set(const std::vector<std::string>& keys,
                           const std::vector<std::string>& values) {
  if (keys.size() != values.size()) {
    throw StoreError("multi_set: " + std::to_string(keys.size()) + " keys but " +
                     std::to_string(values.size()) + " values");
  }
  check_keys(Op::MultiSet, keys);
  for (std::size_t i = 0; i < keys.size(); ++i) check_value(Op::MultiSet, keys[i], values[i]);
  auto lock = lock_call();
  Writer w = begin_locked(Op::MultiSet);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (std::size_t i = 0; i < keys.size(); ++i) {
    w.bytes(keys[i]);
    w.bytes(values[i]);
  }
  const Reply r = exchange_locked(w, Op::MultiSet, kNotBlocking);
  expect_ok_locked(r, Op::MultiSet, [&] { return quote_list(keys); });
  Reader rd(r.payload);
  const uint64_t revision = rd.u64();
  finish_locked(rd, Op::MultiSet);
  return revision;
}

int64_t Client::queue_push(std::string_view queue, std::string_view value) {
  check_key(Op::QueuePush, queue);
  check_value(Op::QueuePush, queue, value);
  auto lock = lock_call();
  Writer w = begin_locked(Op::QueuePush);
  w.bytes(queue);
  w.bytes(value);
  const Reply r = exchange_locked(w, Op::QueuePush, kNotBlocking);
  expect_ok_locked(r, Op::QueuePush, [&] { return "queue " + quote(queue); });
  Reader rd(r.payload);
  const int64_t n = rd.i64();
  finish_locked(rd, Op::QueuePush);
  return n;
}

std::optional<std::string> Client::queue_pop(std::string_view queue, Timeout timeout) {
  check_key(Op::QueuePop, queue);
  auto lock = lock_call();
  const uint32_t t = wire_timeout(timeout);
  Writer w = begin_locked(Op::QueuePop);
  w.bytes(queue);
  w.u32(t);
  const auto start = Clock::now();
  const Reply r = exchange_locked(w, Op::QueuePop, t);
  Reader rd(r.payload);
  if (r.status == static_cast<uint8_t>(Status::Timeout)) {
    finish_locked(rd, Op::QueuePop);
    if (t == 0) return std::nullopt;
    throw TimeoutError("queue_pop timed out after " + fmt_seconds(seconds(Clock::now() - start)) +
                       " waiting on queue " + quote(queue));
  }
  expect_ok_locked(r, Op::QueuePop, [&] { return "queue " + quote(queue); });
  std::string value(rd.bytes(kMaxReplyField));
  finish_locked(rd, Op::QueuePop);
  return value;
}

int64_t Client::queue_len(std::string_view queue) {
  check_key(Op::QueueLen, queue);
  auto lock = lock_call();
  Writer w = begin_locked(Op::QueueLen);
  w.bytes(queue);
  const Reply r = exchange_locked(w, Op::QueueLen, kNotBlocking);
  expect_ok_locked(r, Op::QueueLen, [&] { return "queue " + quote(queue); });
  Reader rd(r.payload);
  const int64_t n = rd.i64();
  finish_locked(rd, Op::QueueLen);
  return n;
}

void Client::ping() {
  auto lock = lock_call();
  const uint64_t nonce = (static_cast<uint64_t>(rng_()) << 32) ^ rng_();
  Writer w = begin_locked(Op::Ping);
  w.u64(nonce);
  const Reply r = exchange_locked(w, Op::Ping, kNotBlocking);
  expect_ok_locked(r, Op::Ping, [] { return std::string(); });
  Reader rd(r.payload);
  const uint64_t echoed = rd.u64();
  finish_locked(rd, Op::Ping);
  if (echoed != nonce) fail_protocol_locked("PING echoed a different nonce");
}

uint64_t Client::barrier(std::string_view key, int64_t world_size, Timeout timeout) {
  check_key(Op::Barrier, key);
  if (world_size < 1 || static_cast<uint64_t>(world_size) > UINT32_MAX) {
    throw StoreError("barrier " + quote(key) + ": world_size must be in [1, " +
                     std::to_string(UINT32_MAX) + "], got " + std::to_string(world_size));
  }
  auto lock = lock_call();
  const uint32_t t = wire_timeout(timeout);
  Writer w = begin_locked(Op::Barrier);
  w.bytes(key);
  w.u32(static_cast<uint32_t>(world_size));
  w.u32(t);
  const auto start = Clock::now();
  const Reply r = exchange_locked(w, Op::Barrier, t);
  Reader rd(r.payload);
  if (r.status == static_cast<uint8_t>(Status::Timeout)) {
    const uint32_t arrived = rd.u32();
    const uint32_t size = rd.u32();
    finish_locked(rd, Op::Barrier);
    throw TimeoutError("barrier " + quote(key) + " timed out after " +
                       fmt_seconds(seconds(Clock::now() - start)) + " (arrived " +
                       std::to_string(arrived) + "/" + std::to_string(size) + ")");
  }
  expect_ok_locked(r, Op::Barrier, [&] { return quote(key); });
  const uint64_t generation = rd.u64();
  finish_locked(rd, Op::Barrier);
  return generation;
}

WatchEvent Client::watch(std::string_view key, std::optional<uint64_t> after_revision,
                         Timeout timeout, bool prefix) {
  check_key(Op::Watch, key);
  auto lock = lock_call();
  const uint32_t t = wire_timeout(timeout);
  const uint64_t after = after_revision ? *after_revision : kWatchFromNow;
  Writer w = begin_locked(Op::Watch);
  w.bytes(key);
  w.u8(prefix ? 1 : 0);
  w.u64(after);
  w.u32(t);
  const auto start = Clock::now();
  const Reply r = exchange_locked(w, Op::Watch, t);
  auto subject = [&] { return (prefix ? "prefix " : "key ") + quote(key); };
  auto since = [&] {
    return after_revision ? "after revision " + std::to_string(after) : std::string("from now");
  };
  Reader rd(r.payload);
  if (r.status == static_cast<uint8_t>(Status::Timeout)) {
    const uint64_t current = rd.u64();
    finish_locked(rd, Op::Watch);
    throw TimeoutError("watch timed out after " + fmt_seconds(seconds(Clock::now() - start)) +
                       " for " + subject() + ": no change " + since() + " (current revision " +
                       std::to_string(current) + ")");
  }
  if (r.status == static_cast<uint8_t>(Status::Compacted)) {
    const uint64_t oldest = rd.u64();
    finish_locked(rd, Op::Watch);
    throw CompactedError("watch " + subject() + ": changes " + since() +
                             " were compacted from the history; the oldest revision held is " +
                             std::to_string(oldest),
                         oldest);
  }
  expect_ok_locked(r, Op::Watch, subject);
  WatchEvent ev;
  const uint8_t kind = rd.u8();
  ev.key = std::string(rd.bytes(kMaxReplyField));
  ev.value = std::string(rd.bytes(kMaxReplyField));
  ev.revision = rd.u64();
  finish_locked(rd, Op::Watch);
  if (kind != static_cast<uint8_t>(EventKind::Set) &&
      kind != static_cast<uint8_t>(EventKind::Delete)) {
    fail_protocol_locked("WATCH returned event kind " + std::to_string(kind));
  }
  ev.kind = static_cast<EventKind>(kind);
  return ev;
}

std::vector<std::pair<std::string, uint64_t>> Client::stats() {
  auto lock = lock_call();
  Writer w = begin_locked(Op::Stats);
  const Reply r = exchange_locked(w, Op::Stats, kNotBlocking);
  expect_ok_locked(r, Op::Stats, [] { return std::string(); });
  Reader rd(r.payload);
  const uint32_t n = rd.count(UINT32_MAX, 4 + 8);
  std::vector<std::pair<std::string, uint64_t>> out;
  out.reserve(n);
  for (uint32_t i = 0; i < n && rd.ok(); ++i) {
    std::string name(rd.bytes(kMaxReplyField));
    const uint64_t v = rd.u64();
    out.emplace_back(std::move(name), v);
  }
  finish_locked(rd, Op::Stats);
  return out;
}

}  // namespace elasticstore
