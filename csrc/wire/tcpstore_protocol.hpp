// torch's TCPStore wire protocol (torch 2.13): request parsing and reply encoding. No sockets.
// Facts: docs/tcpstore-compat.md. Requests carry no length header, so a Scanner first walks a
// request's length fields as its bytes arrive, resuming where it stopped (O(bytes) however the
// request is split), and checks every declared length against its limit and the request's
// running total against kMaxRequestBytes before waiting for (or buffering) the bytes. Once the
// scanner knows the whole request is there, parse_request() decodes it once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "wire/protocol.hpp"

namespace elasticstore::tcpstore {

inline constexpr uint32_t kValidationMagic = 0x3C85F7CEu;
// Prefix torch's client adds to every key, and the counter its clients bump on connect.
inline constexpr std::string_view kClientKeyPrefix = "/";
inline constexpr std::string_view kInitKey = "init/";
// The most bytes one request may declare (opcode, lengths and data), as the native kMaxFrameBytes:
// one maximal value with its key; multi-requests share it.
inline constexpr std::size_t kMaxRequestBytes = kMaxFrameBytes;

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

// Finds where the request at the front of a buffer ends. Each call is given the same request's
// bytes from its start (more of them each time) and continues from the field it stopped at; a
// field's length is re-read only while the field itself is incomplete. After Ready, length() is
// the request's size and the next request needs reset().
class Scanner {
 public:
  Parse scan(const char* data, std::size_t size, std::string* reason);
  std::size_t length() const noexcept { return pos_; }
  void reset() noexcept { *this = Scanner(); }

 private:
  enum class Field : uint8_t { None, U32, I64, Key, Value, Count };
  Field next_field() const noexcept;
  uint8_t op_ = 0;
  std::size_t pos_ = 0;     // bytes of the request scanned (0: not even the opcode)
  uint64_t fields_ = 0;     // fields scanned after the opcode
  uint64_t count_ = 0;      // CHECK/WAIT/MULTI_*: the declared number of keys (pairs)
};

// Reply encoders (appending to a connection's output).
void put_u8(std::string& out, uint8_t v);
void put_u32(std::string& out, uint32_t v);
void put_i64(std::string& out, int64_t v);
void put_bytes(std::string& out, std::string_view v);  // u64 length + bytes

}  // namespace elasticstore::tcpstore
