// The blocking client's transport (see client.hpp): address resolution, connecting with backoff,
// the socket and its keepalive, send/recv/poll against deadlines, interrupt checks, and the
// eventfd that close() signals. It knows frames only as bytes; client.cpp encodes requests and
// decodes replies.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <string_view>

#include "client.hpp"

namespace elasticstore {

namespace client_detail {
using Clock = std::chrono::steady_clock;

// Buffers grown past this by a large request or reply are released afterwards.
inline constexpr std::size_t kKeepBufferBytes = 1024 * 1024;
// The last connect attempt, made at the deadline, and its handshake still get this window.
inline constexpr std::chrono::milliseconds kLastAttemptWindow{100};

std::string errno_text(int err);
double seconds(Clock::duration d);
std::string fmt_seconds(double s);
// A key for a message: quoted, non-printable bytes escaped, long keys cut.
std::string quote(std::string_view s);
Clock::time_point deadline_after(Clock::time_point from, Timeout t);
}  // namespace client_detail

// One connection's transport. Not thread-safe: the Client serializes calls with its mutex; only
// signal_close(), closed() and check_not_closed() may be called from any thread.
class ClientTransport {
 public:
  using Clock = client_detail::Clock;

  // host is numeric or a name (no brackets). interrupt_check and interruptible (see
  // ClientOptions) must outlive the transport. on_close runs whenever the socket is dropped, so
  // that the caller's session state follows.
  ClientTransport(std::string host, uint16_t port, const std::function<bool()>& interrupt_check,
                  const std::function<bool()>& interruptible, std::function<void()> on_close);
  ~ClientTransport();
  ClientTransport(const ClientTransport&) = delete;
  ClientTransport& operator=(const ClientTransport&) = delete;

  std::string endpoint() const;
  bool is_open() const { return fd_ >= 0; }
  // Marks the transport closed for good and wakes a wait in progress. Idempotent.
  void signal_close();
  void check_not_closed() const;

  // Connects, retrying with jittered exponential backoff until timeout; handshake(deadline) runs
  // on each new socket, and a NetworkError from it counts as a failed attempt.
  void connect(Timeout timeout, const std::function<void(Clock::time_point)>& handshake);
  // False when the idle connection is dead (EOF) or out of step (unsolicited bytes).
  bool idle_alive();
  // Closes the socket and drops buffered bytes.
  void close_fd();
  [[noreturn]] void fail_network(const std::string& what);

  // Waits for events on the socket (not open: only sleeps) until deadline; false on deadline.
  // Throws NetworkError when signal_close() was called, InterruptedError when interrupt_check
  // says so. `doing` and `what` (e.g. "sending", "SET") only name the wait in those errors.
  bool wait_fd(short events, Clock::time_point deadline, const char* doing, const char* what);
  // `name` (e.g. "SET") only names the request in errors.
  void send_all(const char* data, std::size_t size, Clock::time_point deadline, const char* name);

  // Bytes received and not yet consumed; valid until the next receive() or drop_consumed().
  std::string_view buffered() const { return std::string_view(rbuf_.data(), rlen_); }
  // The first n buffered bytes (a reply) are dropped by the next drop_consumed().
  void consume_later(std::size_t n) { consume_ = n; }
  void drop_consumed();
  // Receives more bytes, with room for at least `want` buffered; false when the deadline passed.
  bool receive(std::size_t want, Clock::time_point deadline, const char* name);

 private:
  bool try_connect_once(Clock::time_point deadline, std::string* error);

  const std::string host_;
  const uint16_t port_;
  const std::function<bool()>& interrupt_check_;
  const std::function<bool()>& interruptible_;
  const std::function<void()> on_close_;
  int fd_ = -1;
  int wake_fd_ = -1;  // eventfd signalled by signal_close() to abort a call in progress
  std::atomic<bool> closed_{false};
  bool connected_once_ = false;
  std::string rbuf_;         // raw storage for received bytes; size() is the capacity
  std::size_t rlen_ = 0;     // bytes of rbuf_ holding data
  std::size_t consume_ = 0;  // bytes of the last reply, dropped when the next request begins
  std::minstd_rand rng_;
};

}  // namespace elasticstore
