// The elasticstore server: listens on one TCP port and serves the store from one event-loop thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/kv_state.hpp"
#include "wire/log.hpp"
#include "wire/protocol.hpp"

namespace elasticstore {

// Dead-peer detection on every accepted connection (TCP keepalive): after kKeepaliveIdleMs without
// traffic the kernel probes every kKeepaliveIntervalMs and, after kKeepaliveCount unanswered
// probes, reports the connection dead (ETIMEDOUT); TCP_USER_TIMEOUT of the same total bounds data
// the peer never acknowledges. A peer gone without FIN or RST (powered off, partitioned) is thus
// closed, and its session keys dropped, within keepalive_bound_ms() (16 s by default). The user
// timeout also closes a live peer whose receive window stays closed that long (it stopped reading
// while replies were pending).
inline constexpr uint32_t kKeepaliveIdleMs = 10'000;
inline constexpr uint32_t kKeepaliveIntervalMs = 2'000;
inline constexpr uint32_t kKeepaliveCount = 3;
// The kernel counts keepalive times in whole seconds, up to these.
inline constexpr uint32_t kKeepaliveMaxMs = 32'767'000;  // TCP_MAX_KEEPIDLE, TCP_MAX_KEEPINTVL
inline constexpr uint32_t kKeepaliveMaxCount = 127;      // TCP_MAX_KEEPCNT

// Every limit defaults to its named constant (protocol.hpp); docs/protocol.md lists them. Server's
// constructor refuses (std::invalid_argument, naming the field) a value outside its range:
// validate_config() below.
struct ServerConfig {
  std::string host = "127.0.0.1";  // numeric IPv4/IPv6, "" / "0.0.0.0" / "::" (dual-stack), "localhost"
  uint16_t port = 0;               // 0: the kernel picks; port() tells which
  int backlog = 0;                 // 0: /proc/sys/net/core/somaxconn
  std::size_t max_connections = kDefaultMaxConnections;
  // Connections open at once from one peer IP address; past it the accept is refused (logged).
  std::size_t max_connections_per_peer = kDefaultMaxConnectionsPerPeer;
  LogLevel log_level = LogLevel::Warning;
  // Time a client has to finish a request it started (a slow sender cannot hold a buffer).
  uint32_t frame_timeout_ms = kFrameTimeoutMs;
  // Time from accept until the handshake is done (native HELLO, torch's VALIDATE).
  uint32_t handshake_timeout_ms = kHandshakeTimeoutMs;
  // Dead-peer detection (above). Idle and interval: whole seconds in ms, 1000..kKeepaliveMaxMs;
  // count 1..kKeepaliveMaxCount. Any of the three 0: off (a silent peer then holds its
  // connection and session keys until the kernel's own limits, hours for an idle one).
  uint32_t keepalive_idle_ms = kKeepaliveIdleMs;
  uint32_t keepalive_interval_ms = kKeepaliveIntervalMs;
  uint32_t keepalive_count = kKeepaliveCount;
  // Budget of bytes buffered across connections (unfinished requests plus unsent replies); a
  // connection that would take the total past it is closed.
  std::size_t max_buffered_bytes = kMaxBufferedBytes;
  // Unsent replies of one connection (its unfinished request is bounded by kMaxFrameBytes): a reply
  // that would go past it closes the connection. At least kOutputPauseBytes.
  std::size_t max_connection_buffer_bytes = kMaxWriteBufferBytes;
  // Key/value size and keys per request (at most their constants: frames stay bounded), blocked
  // requests per connection, and what the store holds (keys plus queued items, their bytes).
  StoreLimits limits;
  // Authentication (docs/authentication.md). Empty: none. Otherwise native clients prove this
  // token (1..kMaxTokenBytes bytes) in the handshake, and torch's TCPStore protocol, which cannot,
  // is served only to loopback, allowed peers and the ranges below.
  std::string token;
  // With a token: CIDRs (or addresses) whose peers may use torch's unauthenticated protocol.
  std::vector<std::string> allow_unauthenticated_from;
  // With a token: peers the job vouches for at start (more: Server::allow_peer, ALLOW_PEERS).
  std::vector<std::string> allowed_peers;
  // With a token: loopback peers running as the server's user may use torch's protocol. Turned
  // off only by tests.
  bool allow_loopback = true;
  // With a token: false refuses torch's protocol from every peer (a server that only native
  // clients use, such as a rendezvous server). Without a token every peer is served anyway.
  bool torch_protocol = true;
};

// Throws std::invalid_argument naming the field and its range when a value is out of range.
void validate_config(const ServerConfig& config);

// Whether dead-peer detection is on, and the time after which a silent peer's connection is
// closed: idle + interval * count ms (0 when off). Also its TCP_USER_TIMEOUT.
bool keepalive_enabled(const ServerConfig& config) noexcept;
uint64_t keepalive_bound_ms(const ServerConfig& config) noexcept;

class Server {
 public:
  // Resolves, binds and listens on the caller's thread; throws std::system_error or
  // std::runtime_error when that fails. Sets the process-wide log level from the config.
  explicit Server(ServerConfig config = {});
  ~Server();  // stop()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  const std::string& host() const noexcept;  // numeric address actually bound
  uint16_t port() const noexcept;             // actual port
  // Runs the event loop on a new thread. Throws std::runtime_error after stop() (no restart).
  void start();
  // Idempotent: wakes the loop, joins its thread, closes every socket. Not from the loop thread.
  void stop() noexcept;
  bool running() const noexcept;
  // A snapshot published by the loop before each poll (thread-safe; never blocks the loop).
  std::vector<std::pair<std::string, uint64_t>> stats() const;
  // The peers allowed to use torch's TCPStore protocol when the server has a token (thread-safe).
  // An address or CIDR; throws std::invalid_argument when one does not parse.
  void allow_peer(const std::string& addr);
  void set_allowed_peers(const std::vector<std::string>& addrs);  // replaces; all or nothing
  std::vector<std::string> allowed_peers() const;
  bool requires_token() const noexcept;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace elasticstore
