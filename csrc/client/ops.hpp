// Internal to the client's .cpp files: limits, argument checks and message helpers shared by the
// operations (ops.cpp, blocking_ops.cpp) and the exchange (client.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "client/client.hpp"
#include "client/transport.hpp"

namespace elasticstore {
namespace client_detail {

// Requests that never block server-side carry no timeout; their reply deadline is op_timeout.
inline constexpr uint32_t kNotBlocking = 0;
// A reply frame larger than this is a protocol error (no allocation trusts a declared length).
inline constexpr std::size_t kMaxReplyFrameBytes = kMaxReplyBytes + kMaxFrameBytes;
// Reply fields are bounded by the frame; the server enforces the real limits.
inline constexpr std::size_t kMaxReplyField = kMaxReplyFrameBytes;

std::string lower_op(Op op);
uint32_t wire_timeout(Timeout t);
void check_key(Op op, std::string_view key);
void check_value(Op op, std::string_view key, std::string_view value);
void check_keys(Op op, const std::vector<std::string>& keys);
void read_keys(Reader& rd, std::vector<std::string>* out);

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

}  // namespace client_detail
}  // namespace elasticstore
