// One client connection: its socket, buffers and a single documented state machine (memcached
// style). The first bytes pick the codec; the codec turns whole requests into KvState calls.
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <string>

#include "server/codec.hpp"
#include "server/event_loop.hpp"
#include "wire/buffer.hpp"

namespace elasticstore {

// AwaitingPreamble -> Handshaking -> Serving -> Closing. Any state may go to Closing; nothing
// leaves it.
enum class ConnState : uint8_t {
  AwaitingPreamble,  // no codec yet: the first byte picks one ('E' native, 0x00 torch's TCPStore)
  Handshaking,       // codec chosen; only its handshake is accepted (native: HELLO)
  Serving,           // every opcode of the codec
  Closing,           // reason logged; no more input or replies; the server reaps it before polling
};
const char* state_name(ConnState s) noexcept;

// What a connection needs from the server while it processes input.
class ConnectionHost : public StatsSource {
 public:
  virtual KvState& kv() noexcept = 0;
  // Encodes the completions queued by the last command into their connections' write buffers.
  virtual void drain_ready() = 0;
  // Counts one request handled (any codec), for the `requests` statistic.
  virtual void count_request() noexcept = 0;
  // The token and the peers allowed to use torch's unauthenticated protocol.
  virtual ServerAuth& auth() noexcept = 0;
};

class Connection {
 public:
  // `max_output_bytes`: unsent replies past which the connection closes (kMaxWriteBufferBytes by
  // default; ServerConfig::max_connection_buffer_bytes).
  Connection(int fd, ConnId id, std::string peer, std::size_t max_output_bytes = kMaxWriteBufferBytes) noexcept;
  ~Connection();  // closes the socket
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  int fd() const noexcept { return fd_; }
  ConnId id() const noexcept { return id_; }
  const std::string& peer() const noexcept { return peer_; }
  ConnState state() const noexcept { return state_; }
  void set_state(ConnState next) noexcept;

  // Reads once into `scratch` and handles every whole request, stopping early while paused().
  // Returns false when the connection must close; close_reason()/bad_input() then say why.
  bool on_readable(ConnectionHost& host, char* scratch, std::size_t scratch_size);
  // Handles the requests held back while paused (none are read from the socket). False: closing.
  bool resume(ConnectionHost& host);
  // Writes as much of the write buffer as the kernel takes. False on a socket error.
  bool flush();
  // Appends a finished blocking request if it fits the connection's output limit and the
  // server's budget (`global_room` left of `global_limit`); otherwise closes the connection and
  // returns false.
  bool deliver(const Completion& c, const KvState& kv, std::size_t global_room,
               std::size_t global_limit);

  bool wants_write() const noexcept { return !out_.empty(); }
  // Unsent replies over kOutputPauseBytes: read no requests until they drain.
  bool paused() const noexcept { return out_.size() > kOutputPauseBytes; }
  // Whole requests already read but held back by a pause (handled by resume()).
  bool input_held() const noexcept { return held_; }
  bool has_partial_request() const noexcept { return !in_.empty() && !held_; }
  bool progressed() const noexcept { return progressed_; }  // a request completed in last read
  std::size_t buffered_bytes() const noexcept { return in_.size() + out_.size(); }
  const std::string& close_reason() const noexcept { return close_reason_; }
  bool bad_input() const noexcept { return bad_input_; }
  // The kernel gave up on the peer (ETIMEDOUT, EHOSTUNREACH, ENETUNREACH from a read or write):
  // keepalive probes or retransmissions went unanswered. It is gone without FIN or RST.
  bool peer_lost() const noexcept { return peer_lost_; }
  void fail(std::string reason, bool bad_input);

  // Server bookkeeping.
  sockaddr_storage peer_addr{};  // checked against ServerAuth::allowed for torch's protocol
  EventLoop::TimerId frame_timer = 0;
  EventLoop::TimerId handshake_timer = 0;  // armed at accept, until the handshake is done
  uint32_t events = 0;          // kReadable/kWritable registered with the loop
  bool dirty = false;           // in the server's flush list
  bool queued_close = false;    // session closed, awaiting reaping
  std::size_t accounted = 0;    // bytes counted in the server's bytes_buffered
  std::string peer_ip;          // counted in the server's per-address connection count
  // Until the handshake is done: its place in the server's lists of such connections.
  bool half_open = false;
  std::list<ConnId>::iterator half_open_pos, half_open_peer_pos;

 private:
  std::size_t handle(ConnectionHost& host, const char* data, std::size_t size);
  std::size_t sniff(ConnectionHost& host, const char* data, std::size_t size);
  void io_failed(const char* op, int err);

  int fd_;
  ConnId id_;
  std::string peer_;
  std::size_t max_output_;
  ConnState state_ = ConnState::AwaitingPreamble;
  std::unique_ptr<Codec> codec_;
  Buffer in_;   // only an incomplete request is kept here between reads
  Buffer out_;
  std::string close_reason_;
  bool bad_input_ = false;
  bool peer_lost_ = false;
  bool progressed_ = false;
  bool held_ = false;  // in_ starts with requests not handled because of a pause
};

}  // namespace elasticstore
