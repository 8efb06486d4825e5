// Range checks of ServerConfig, shared by Server, the Python bindings and elasticstore-server.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "server.hpp"

namespace elasticstore {
namespace {

void in_range(const char* field, std::size_t v, std::size_t lo, std::size_t hi) {
  if (v >= lo && v <= hi) return;
  throw std::invalid_argument(std::string("ServerConfig.") + field + " = " + std::to_string(v) +
                              " is out of range [" + std::to_string(lo) + ", " +
                              std::to_string(hi) + "]");
}

}  // namespace

void validate_config(const ServerConfig& c) {
  constexpr std::size_t kHuge = std::size_t{1} << 50;
  in_range("max_connections", c.max_connections, 1, kHuge);
  in_range("max_connections_per_peer", c.max_connections_per_peer, 1, kHuge);
  in_range("frame_timeout_ms", c.frame_timeout_ms, 1, UINT32_MAX - 1);
  in_range("handshake_timeout_ms", c.handshake_timeout_ms, 1, UINT32_MAX - 1);
  in_range("max_buffered_bytes", c.max_buffered_bytes, 1, kHuge);
  in_range("max_connection_buffer_bytes", c.max_connection_buffer_bytes, kOutputPauseBytes, kHuge);
  in_range("max_key_bytes", c.limits.max_key_bytes, 1, kMaxKeyBytes);
  in_range("max_value_bytes", c.limits.max_value_bytes, 1, kMaxValueBytes);
  in_range("max_keys_per_request", c.limits.max_keys_per_request, 1, kMaxKeysPerRequest);
  in_range("max_waiters_per_connection", c.limits.max_waiters_per_connection, 1, kHuge);
  in_range("max_stored_keys", c.limits.max_stored_keys, 1, kHuge);
  in_range("max_stored_bytes", c.limits.max_stored_bytes, 1, kHuge);
}

}  // namespace elasticstore
