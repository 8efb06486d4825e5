// torch's TCPStore wire protocol (torch 2.13): request parsing and reply encoding. No sockets.
// Facts: docs/tcpstore-compat.md. Requests carry no length header, so a request is parsed
// transactionally from the front of the buffer: nothing is consumed until all of it is there, and
// every declared length is checked against its limit before waiting for (or allocating) the bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "protocol.hpp"

namespace elasticstore::tcpstore {

inline constexpr uint32_t kValidationMagic = 0x3C85F7CEu;
// Prefix torch's client adds to every key, and the counter its clients bump on connect.
inline constexpr std::string_view kClientKeyPrefix = "/";
inline constexpr std::string_view kInitKey = "init/";

enum class Op : uint8_t {
  Validate = 0,
  Set = 1,
  CompareSet = 2,
  Get = 3,
  Add = 4,
  Check = 5,
  Wait = 6,
  GetNumKeys = 7,
  DeleteKey = 8,
  Append = 9,
  MultiGet = 10,
  MultiSet = 11,
  CancelWait = 12,
  Ping = 13,
  QueuePush = 14,
  QueuePop = 15,
  QueueLen = 16,
  ListKeys = 17,
  Barrier = 18,
};
inline constexpr uint8_t kMaxOp = 18;

const char* op_name(uint8_t op);

// One parsed request. The views point into the caller's buffer and stay valid until it consumes
// `consumed` bytes.
struct Request {
  Op op = Op::Validate;
  std::vector<std::string_view> keys;    // SET/GET/ADD/...: keys[0]; CHECK/WAIT/MULTI_*: all
  std::vector<std::string_view> values;  // SET/APPEND/QUEUE_PUSH: values[0]; COMPARE_SET: expected,
                                         // desired; MULTI_SET: one per key
  int64_t number = 0;                    // ADD delta, BARRIER world size
  uint32_t word = 0;                     // VALIDATE magic, PING nonce
  std::size_t consumed = 0;              // bytes this request occupies
};

enum class Parse { NeedMore, Ready, Malformed, TooLarge, UnknownOp };

// Parses the request at the front of [data, data + size). On Malformed/TooLarge/UnknownOp,
// `reason` says why (for the log line that precedes closing the connection).
Parse parse_request(const char* data, std::size_t size, Request* out, std::string* reason);

// Reply encoders (appending to a connection's output).
void put_u8(std::string& out, uint8_t v);
void put_u32(std::string& out, uint32_t v);
void put_i64(std::string& out, int64_t v);
void put_bytes(std::string& out, std::string_view v);  // u64 length + bytes

}  // namespace elasticstore::tcpstore
