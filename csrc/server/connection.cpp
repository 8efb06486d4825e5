#include "server/connection.hpp"

#include <linux/tcp.h>  // struct tcp_info with tcpi_snd_wnd (not in glibc's netinet/tcp.h)
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "server/peer_cred.hpp"
#include "wire/log.hpp"

namespace elasticstore {

const char* state_name(ConnState s) noexcept {
  switch (s) {
    case ConnState::AwaitingPreamble: return "AwaitingPreamble";
    case ConnState::Handshaking: return "Handshaking";
    case ConnState::Serving: return "Serving";
    case ConnState::Closing: return "Closing";
  }
  return "?";
}

Connection::Connection(int fd, ConnId id, std::string peer, std::size_t max_output_bytes) noexcept
    : fd_(fd), id_(id), peer_(std::move(peer)), max_output_(max_output_bytes) {}

Connection::~Connection() {
  if (fd_ >= 0) ::close(fd_);
}

void Connection::set_state(ConnState next) noexcept {
  if (state_ == next || state_ == ConnState::Closing) return;
  log(LogLevel::Debug, "connection %s: %s -> %s", peer_.c_str(), state_name(state_), state_name(next));
  state_ = next;
}

void Connection::fail(std::string reason, bool bad_input) {
  if (state_ == ConnState::Closing) return;
  close_reason_ = std::move(reason);
  bad_input_ = bad_input;
  set_state(ConnState::Closing);
  in_.clear();
  out_.clear();
}

namespace {

// Whether the peer's last advertised receive window was zero (it stopped reading), when the
// kernel tells (TCP_INFO's tcpi_snd_wnd, Linux 5.19+; false when it does not).
bool window_closed(int fd) noexcept {
  tcp_info info{};
  socklen_t len = sizeof info;
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return false;
  return len >= offsetof(tcp_info, tcpi_snd_wnd) + sizeof info.tcpi_snd_wnd && info.tcpi_snd_wnd == 0;
}

}  // namespace

// A failed read or write. ETIMEDOUT (or, with ICMP errors seen meanwhile, EHOSTUNREACH or
// ENETUNREACH) means the kernel gave up on the peer: no answer to keepalive probes or to
// retransmissions within the user timeout, or, for a peer that answers but keeps its receive
// window closed (it stopped reading while replies were pending), no room for that long.
void Connection::io_failed(const char* op, int err) {
  if (state_ == ConnState::Closing) return;
  const bool lost = err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH;
  const char* what = !lost ? "" : window_closed(fd_) ? "peer stopped reading, its receive window "
                                                       "stayed closed (" : "peer unreachable (";
  fail(std::string(what) + op + " failed: " + std::strerror(err) + (lost ? ")" : ""), false);
  peer_lost_ = lost;
}

// Returns the bytes the preamble used (0 while more are needed, or when it failed).
std::size_t Connection::sniff(ConnectionHost& host, const char* data, std::size_t size) {
  const auto first = static_cast<uint8_t>(data[0]);
  if (first == kTorchValidateByte) {  // the codec parses VALIDATE itself: nothing consumed
    // torch's protocol cannot authenticate: with a token, only peers the job vouches for.
    if (std::string why; !admits_torch(host.auth(), fd_, peer_addr, &why)) {
      fail("torch TCPStore client refused: " + why, true);
      return 0;
    }
    codec_ = make_tcpstore_codec();
    set_state(ConnState::Handshaking);
    return 0;
  }
  if (first != static_cast<uint8_t>(kNativePreamble[0])) {
    char why[64];
    std::snprintf(why, sizeof why, "unknown protocol (first byte 0x%02x)", first);
    fail(why, true);
    return 0;
  }
  const std::size_t n = size < kPreambleBytes ? size : kPreambleBytes;
  if (std::memcmp(data, kNativePreamble, n) != 0) {
    fail("bad preamble (expected ESTO)", true);
    return 0;
  }
  if (n < kPreambleBytes) return 0;
  codec_ = make_native_codec();
  set_state(ConnState::Handshaking);
  return kPreambleBytes;
}

// Handles whole requests from the front of [data, size); returns the bytes consumed.
std::size_t Connection::handle(ConnectionHost& host, const char* data, std::size_t size) {
  std::size_t used = 0;
  held_ = false;
  while (used < size && state_ != ConnState::Closing) {
    if (paused()) {  // backpressure: the rest waits in in_ until the replies drain
      held_ = true;
      break;
    }
    if (state_ == ConnState::AwaitingPreamble) {
      const std::size_t n = sniff(host, data + used, size - used);
      if (state_ == ConnState::AwaitingPreamble || state_ == ConnState::Closing) break;
      used += n;
      continue;
    }
    CommandContext ctx{host.kv(), id_, out_.tail(), host, host.auth()};
    std::size_t consumed = 0;
    std::string reason;
    const Step s = codec_->step(ctx, data + used, size - used, &consumed, &reason);
    if (s == Step::NeedMore) break;
    if (s == Step::Close) {
      fail(std::move(reason), true);
      break;
    }
    if (s == Step::ReplyAndClose) {  // a refused handshake: the small reply fits the socket buffer
      flush();
      fail(std::move(reason), true);
      break;
    }
    used += consumed;
    progressed_ = true;
    host.count_request();
    if (state_ == ConnState::Handshaking && codec_->handshake_done()) set_state(ConnState::Serving);
    host.drain_ready();  // this connection's own completions land in out_ in request order
    if (out_.size() > max_output_)
      fail("unsent replies over the limit of " + std::to_string(max_output_) +
               " bytes (max_connection_buffer_bytes)", false);
  }
  return used;
}

bool Connection::resume(ConnectionHost& host) {
  if (state_ == ConnState::Closing) return false;
  progressed_ = false;
  if (!held_ || paused()) return true;
  const std::size_t used = handle(host, in_.data(), in_.size());
  if (state_ == ConnState::Closing) return false;
  in_.consume(used);
  return true;
}

bool Connection::on_readable(ConnectionHost& host, char* scratch, std::size_t scratch_size) {
  progressed_ = false;
  if (state_ == ConnState::Closing) return false;
  if (paused()) return true;  // not reading while paused (the server masks kReadable)
  if (held_ && (!resume(host) || held_)) return state_ != ConnState::Closing;
  const ssize_t n = ::read(fd_, scratch, scratch_size);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return true;
    io_failed("read", errno);
    return false;
  }
  if (n == 0) {
    fail(in_.empty() ? "peer closed" : "peer closed in the middle of a request", false);
    return false;
  }
  // Parse straight from the scratch buffer when nothing is pending, so a connection copies only
  // the tail of an incomplete request into its own buffer.
  const bool from_scratch = in_.empty();
  if (!from_scratch) in_.append(scratch, static_cast<std::size_t>(n));
  const char* data = from_scratch ? scratch : in_.data();
  const std::size_t size = from_scratch ? static_cast<std::size_t>(n) : in_.size();
  const std::size_t used = handle(host, data, size);
  if (state_ == ConnState::Closing) return false;
  if (from_scratch) {
    // No reserve for the declared frame size: a peer could declare 8 MiB on every connection
    // and send nothing more. Geometric growth costs little more and follows real bytes.
    if (used < size) in_.append(data + used, size - used);
  } else {
    in_.consume(used);
  }
  return true;
}

bool Connection::flush() {
  while (!out_.empty()) {
    const ssize_t n = ::send(fd_, out_.data(), out_.size(), MSG_NOSIGNAL);
    if (n > 0) {
      out_.consume(static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return true;
    } else {
      io_failed("write", errno);
      return false;
    }
  }
  return true;
}

bool Connection::deliver(const Completion& c, const KvState& kv, std::size_t global_room,
                         std::size_t global_limit) {
  if (state_ == ConnState::Closing || !codec_) return true;
  // Give the kernel what it takes first, so that only output the peer really left unread counts.
  if (out_.size() > kOutputPauseBytes && !flush()) return false;
  const std::size_t own_room = out_.size() < max_output_ ? max_output_ - out_.size() : 0;
  const bool budget_bound = global_room < own_room;
  std::string reason;
  if (!codec_->complete(c, kv, out_.tail(), budget_bound ? global_room : own_room, &reason)) {
    if (budget_bound)
      reason = "dropped to keep the server's buffers within their budget of " +
               std::to_string(global_limit) + " bytes across connections (" + reason + ")";
    fail(std::move(reason), false);
    return false;
  }
  return true;
}

}  // namespace elasticstore
