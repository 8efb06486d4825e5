// Range checks of ServerConfig, shared by Server, the Python bindings and elasticstore-server.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "server/server.hpp"

namespace elasticstore {
namespace {

void in_range(const char* field, std::size_t v, std::size_t lo, std::size_t hi) {
  if (v >= lo && v <= hi) return;
  throw std::invalid_argument(std::string("ServerConfig.") + field + " = " + std::to_string(v) +
                              " is out of range [" + std::to_string(lo) + ", " +
                              std::to_string(hi) + "]");
}

// 0 (off), or whole seconds in ms within [1000, kKeepaliveMaxMs].
void keepalive_ms(const char* field, uint32_t v) {
  if (v == 0 || (v >= 1000 && v <= kKeepaliveMaxMs && v % 1000 == 0)) return;
  throw std::invalid_argument(std::string("ServerConfig.") + field + " = " + std::to_string(v) +
                              " is not 0 (off) nor a whole number of seconds in [1000, " +
                              std::to_string(kKeepaliveMaxMs) +
                              "] ms (TCP keepalive counts whole seconds)");
}

}  // namespace

bool keepalive_enabled(const ServerConfig& c) noexcept {
  return c.keepalive_idle_ms != 0 && c.keepalive_interval_ms != 0 && c.keepalive_count != 0;
}

uint64_t keepalive_bound_ms(const ServerConfig& c) noexcept {
  if (!keepalive_enabled(c)) return 0;
  return uint64_t{c.keepalive_idle_ms} + uint64_t{c.keepalive_interval_ms} * c.keepalive_count;
}

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
  in_range("barrier_idle_ms", c.limits.barrier_idle_ms, 1, UINT32_MAX - 1);
  keepalive_ms("keepalive_idle_ms", c.keepalive_idle_ms);
  keepalive_ms("keepalive_interval_ms", c.keepalive_interval_ms);
  if (c.keepalive_count > kKeepaliveMaxCount)
    throw std::invalid_argument("ServerConfig.keepalive_count = " + std::to_string(c.keepalive_count) +
                                " is not 0 (off) nor in [1, " + std::to_string(kKeepaliveMaxCount) +
                                "] (the kernel's TCP_MAX_KEEPCNT)");
}

}  // namespace elasticstore
