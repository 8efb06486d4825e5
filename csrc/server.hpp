// The elasticstore server: listens on one TCP port and serves the store from one event-loop thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "log.hpp"
#include "protocol.hpp"

namespace elasticstore {

struct ServerConfig {
  std::string host = "127.0.0.1";  // numeric IPv4/IPv6, "" / "0.0.0.0" / "::" (dual-stack), "localhost"
  uint16_t port = 0;               // 0: the kernel picks; port() tells which
  int backlog = 0;                 // 0: /proc/sys/net/core/somaxconn
  std::size_t max_connections = kDefaultMaxConnections;
  LogLevel log_level = LogLevel::Warning;
  // Time a client has to finish a request it started; lowered only by tests.
  uint32_t frame_timeout_ms = kFrameTimeoutMs;
  // Budget of bytes buffered across connections (unfinished requests plus unsent replies); a
  // connection that would take the total past it is closed. Lowered only by tests.
  std::size_t max_buffered_bytes = kMaxBufferedBytes;
};

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

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace elasticstore
