// The blocking client's transport (see client.hpp): address resolution (forward only, bounded by
// the caller's deadline), connecting with backoff, the socket and its keepalive, send/recv/poll
// against deadlines, interrupt checks, the eventfd that close() signals, and dropping a socket
// inherited across fork(). It knows frames only as bytes; client.cpp encodes requests and decodes
// replies.
//
// The hot path costs two syscalls per call: a send, and a blocking recv cut by the socket's
// receive timeout (SO_RCVTIMEO, kRecvSlice, set once per connection). poll() is used only when no
// reply came within one slice, or when the call's deadline is nearer than a slice; it watches the
// close() eventfd and interrupts. The idle connection's liveness peek is made only when it was
// idle for more than kIdleCheck.
#pragma once

#include <netdb.h>

#include <atomic>
#include <condition_variable>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>

#include "client/client.hpp"
#include "net/lookup.hpp"

namespace elasticstore {

namespace client_detail {
using Clock = std::chrono::steady_clock;

// Buffers grown past this by a large request or reply are released afterwards.
inline constexpr std::size_t kKeepBufferBytes = 1024 * 1024;
// The last connect attempt, made at the deadline, and its handshake still get this window.
inline constexpr std::chrono::milliseconds kLastAttemptWindow{100};
// The socket's receive timeout: a blocking recv waits at most this long before the call falls
// back to poll() (which also watches close() and interrupts). At most kInterruptPollMs.
inline constexpr std::chrono::milliseconds kRecvSlice{kInterruptPollMs};
// A deadline can pass while this process does not run (stopped by SIGSTOP, a debugger, a frozen
// cgroup, or starved of CPU): what the server sent meanwhile still counts. When a blocking recv
// or a poll of a wait returns later than kStallTolerance after it should have (the process was
// not running) and the deadline has passed, the wait gets kStallGrace more, once: a server
// stopped with this process (one hosted in it) answers within that once both run again. Every
// wait past its deadline also takes one last look without waiting before it fails.
inline constexpr std::chrono::milliseconds kStallTolerance{1000};
inline constexpr std::chrono::milliseconds kStallGrace{500};
// A connection unused for longer than this is checked for EOF (a restarted server) before a
// request is sent on it; a recently used one is not (one syscall less per call).
inline constexpr std::chrono::milliseconds kIdleCheck{100};

// Incremented in the child by a pthread_atfork handler: a connection made under another value
// was inherited across fork().
uint64_t fork_generation();  // registers the handler at its first call
uint32_t random_seed();  // a seed for a client's jitter and ids (getrandom)

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
  // False when the idle connection is out of step (unsolicited bytes) or, when it was idle for
  // more than kIdleCheck, dead (EOF).
  bool idle_alive();
  // True when the socket was made by another process (this one is a fork() child). Then
  // drop_inherited() must run before the next call: the parent still uses that socket.
  bool inherited() const { return fork_gen_ != client_detail::fork_generation(); }
  // Closes the inherited socket without sending on it or shutting it down (the parent's
  // connection is untouched), and replaces the close() eventfd, also shared with the parent.
  void drop_inherited();
  // Closes the socket and drops buffered bytes.
  void close_fd();
  [[noreturn]] void fail_network(const std::string& what);

  // Waits for events on the socket (not open: only sleeps) until deadline; false on deadline.
  // Throws NetworkError when signal_close() was called, InterruptedError when interrupt_check
  // says so. `doing` and `what` (e.g. "sending", "SET") only name the wait in those errors.
  // stalled: the caller's blocking recv found this process stopped (kStallGrace).
  bool wait_fd(short events, Clock::time_point deadline, const char* doing, const char* what,
               bool stalled = false);
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
  bool try_connect_once(Clock::time_point deadline, std::chrono::milliseconds attempt_cap,
                        std::string* error);
  void check_not_closed_waiting(const char* doing, const char* what);
  [[noreturn]] void eof_while(const char* name);
  [[noreturn]] void recv_failed(const char* name, int err);
  // The addresses of host_ (numeric: at once; a name: forward lookup on a thread, waited for
  // until deadline). Null with *error set when it failed or did not finish in time.
  std::shared_ptr<ResolveJob> resolve(Clock::time_point deadline, std::string* error);

  const std::string host_;
  const uint16_t port_;
  const std::function<bool()>& interrupt_check_;
  const std::function<bool()>& interruptible_;
  const std::function<void()> on_close_;
  int fd_ = -1;
  // eventfd signalled by signal_close() to abort a call in progress; replaced after fork().
  std::atomic<int> wake_fd_{-1};
  std::atomic<uint64_t> fork_gen_{0};  // fork_generation() when wake_fd_ (and fd_) were made
  std::shared_ptr<ResolveJob> resolving_;  // a lookup still running, reused by the next attempt
  Clock::time_point last_used_{};          // when the last reply (or the connection) came
  std::atomic<bool> closed_{false};
  bool connected_once_ = false;
  std::string rbuf_;         // raw storage for received bytes; size() is the capacity
  std::size_t rlen_ = 0;     // bytes of rbuf_ holding data
  std::size_t consume_ = 0;  // bytes of the last reply, dropped when the next request begins
  std::minstd_rand rng_;
};

}  // namespace elasticstore
