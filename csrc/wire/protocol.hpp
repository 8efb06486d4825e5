// The native wire protocol: constants, limits and bounds-checked codecs. No sockets here.
// The frame layout and every opcode's payload are specified in docs/protocol.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace elasticstore {

// ---- connection start -------------------------------------------------------------------------
inline constexpr char kNativePreamble[4] = {'E', 'S', 'T', 'O'};
inline constexpr std::size_t kPreambleBytes = 4;
inline constexpr uint8_t kTorchValidateByte = 0x00;  // first byte of torch's TCPStore VALIDATE
// 2: HELLO carries the client's nonce; AUTH proves the token both ways (docs/protocol.md).
inline constexpr uint32_t kProtocolVersion = 2;
// Version 1 (HELLO without a nonce) is still served by a server without a token.
inline constexpr uint32_t kMinProtocolVersion = 1;

// ---- limits (every size the server accepts is named here) -------------------------------------
inline constexpr std::size_t kMaxKeyBytes = 8 * 1024;
inline constexpr std::size_t kMaxValueBytes = 8 * 1024 * 1024;
inline constexpr std::size_t kMaxKeysPerRequest = 128 * 1024;
inline constexpr std::size_t kFrameHeaderBytes = 4 + 1 + 4;  // len, opcode/status, request id
inline constexpr std::size_t kMinFrameBody = 1 + 4;
// A frame must fit one maximal value plus its key and framing; multi-requests share this budget.
inline constexpr std::size_t kMaxFrameBytes = kMaxValueBytes + 2 * kMaxKeyBytes + 64;
// A reply larger than this (e.g. a MULTI_GET of many large values) is refused with TOO_LARGE.
inline constexpr std::size_t kMaxReplyBytes = 64 * 1024 * 1024;
// Backpressure (Redis's client output buffer limits): while a connection's unsent replies exceed
// kOutputPauseBytes the server reads no more of its requests (the peer's sends then block in TCP)
// and resumes once they drain below it. Replies already owed (one request's, or wake-ups of its
// blocked requests) may take it up to kMaxWriteBufferBytes, one maximal reply past the pause
// bound; a reply that would go further closes the connection as a peer that does not read.
inline constexpr std::size_t kOutputPauseBytes = 1024 * 1024;
inline constexpr std::size_t kMaxWriteBufferBytes = kOutputPauseBytes + kFrameHeaderBytes + kMaxReplyBytes;
// Bytes buffered across all connections (unfinished requests plus unsent replies). A connection
// whose input or reply would take the total past it is closed with a logged reason.
inline constexpr std::size_t kMaxBufferedBytes = std::size_t{1024} * 1024 * 1024;
// Memory held by blocked requests (their keys and index entries), per connection and in total: a
// blocking request that would go past either is refused with TOO_LARGE (torch's protocol, which has
// no error reply: the connection closes). A connection may pipeline blocking requests, so without
// this bound one peer could park any number of 8 MiB WAITs.
inline constexpr std::size_t kMaxWaitingBytesPerConnection = 64 * 1024 * 1024;
inline constexpr std::size_t kMaxWaitingBytes = std::size_t{1024} * 1024 * 1024;
// Time a client has to finish sending a frame it started.
inline constexpr uint32_t kFrameTimeoutMs = 30'000;
inline constexpr std::size_t kMaxClientNameBytes = 256;
// A session id (HELLO's reply) is the server instance's random tag in the bits above
// kSessionCounterBits and a counter below. A client that reconnects and finds another tag
// refuses that server: it restarted, and the keys and sessions the client knew are gone
// (docs/protocol.md "Sessions"). A tag of 0 (a server before this rule) is never checked.
inline constexpr unsigned kSessionCounterBits = 40;
inline constexpr std::size_t kDefaultMaxConnections = 65'536;
// Connections open at once from one peer IP address; past it the accept is refused (logged).
inline constexpr std::size_t kDefaultMaxConnectionsPerPeer = 8'192;
// Connections that have not finished their handshake (native HELLO/AUTH, torch's VALIDATE), from
// one peer address and in all. Past either, the oldest such connection (of that peer, or of all)
// is closed to make room: a peer that opens connections and never authenticates cannot hold more
// descriptors than this, and never more than 1/kHalfOpenFdShare of the process's descriptor limit.
inline constexpr std::size_t kMaxHalfOpenPerPeer = 1'024;
inline constexpr std::size_t kMaxHalfOpen = 8'192;
inline constexpr std::size_t kHalfOpenFdShare = 2;
// Blocked requests (GET, WAIT, QUEUE_POP, BARRIER, WATCH, ...) one connection may have parked.
inline constexpr std::size_t kDefaultMaxWaitersPerConnection = 16'384;
// What the store holds: keys plus queued items, and their key/name plus value bytes. A write that
// would go past either is refused with TOO_LARGE ("store full"); torch's protocol: closed.
inline constexpr std::size_t kDefaultMaxStoredKeys = 16 * 1024 * 1024;
inline constexpr std::size_t kDefaultMaxStoredBytes = std::size_t{4} * 1024 * 1024 * 1024;
// Time from accept until the handshake is done (native HELLO answered, torch VALIDATE).
inline constexpr uint32_t kHandshakeTimeoutMs = 10'000;
// A released barrier name nobody waits on is forgotten this long after its last arrival
// (StoreLimits::barrier_idle_ms), and at most this many such names are kept (oldest forgotten).
inline constexpr uint32_t kBarrierIdleMs = 600'000;
inline constexpr std::size_t kMaxIdleBarrierNames = 65'536;
// Watch history: recent changes kept so that a watcher never misses one between two watches.
// It must cover how far a watcher lags behind writers, not the data: a watcher further behind
// gets COMPACTED and re-reads. The byte bound keeps a store of large values from doubling.
inline constexpr std::size_t kWatchHistoryEvents = 65'536;
inline constexpr std::size_t kWatchHistoryBytes = 16 * 1024 * 1024;

inline constexpr uint32_t kNoTimeout = 0xFFFFFFFFu;
inline constexpr uint64_t kWatchFromNow = 0xFFFFFFFFFFFFFFFFull;
inline constexpr uint8_t kFlagEphemeral = 0x01;

// The operations and their opcodes: one row each in ops.def.
enum class Op : uint8_t {
#define ELASTICSTORE_OP(Enum, code, wire_name, call_name, kind, handler) Enum = code,
#include "wire/ops.def"
};

// What an operation is for (the kind column of ops.def).
enum class OpKind : uint8_t { Session, Auth, Store, Admin };
const char* op_kind_name(OpKind kind);

struct OpInfo {
  Op op;
  const char* wire_name;  // "COMPARE_SET": logs and error messages
  const char* call_name;  // "compare_set": call statistics and Python's op names
  OpKind kind;
};

inline constexpr OpInfo kOps[] = {
#define ELASTICSTORE_OP(Enum, code, wire_name, call_name, kind, handler) \
  {Op::Enum, wire_name, call_name, OpKind::kind},
#include "wire/ops.def"
};
inline constexpr uint8_t kMaxOp = static_cast<uint8_t>(sizeof kOps / sizeof kOps[0]);

// Opcodes run 1..kMaxOp in table order, so that kOps[code - 1] is the row of `code`.
constexpr bool ops_dense() {
  for (std::size_t i = 0; i < kMaxOp; ++i)
    if (static_cast<std::size_t>(kOps[i].op) != i + 1) return false;
  return true;
}
static_assert(ops_dense(), "ops.def: opcodes must run 1, 2, 3, ... in row order");

// The row of opcode `code`, or null for a code no operation has.
inline const OpInfo* op_info(uint8_t code) {
  return code >= 1 && code <= kMaxOp ? &kOps[code - 1] : nullptr;
}

enum class Status : uint8_t {
  Ok = 0,
  Timeout = 1,
  Error = 2,
  WrongType = 3,
  TooLarge = 4,
  Compacted = 5,
  Unauthenticated = 6,
};

enum class EventKind : uint8_t { Set = 1, Delete = 2 };

const char* op_name(uint8_t op);
const char* status_name(uint8_t status);

// ---- encoding ---------------------------------------------------------------------------------
// Appends little-endian fields to a std::string. begin_frame()/end_frame() write the header and
// patch the length once the payload is known.
class Writer {
 public:
  explicit Writer(std::string& out) : out_(out) {}

  void u8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void u32(uint32_t v) { put(&v, sizeof v); }
  void u64(uint64_t v) { put(&v, sizeof v); }
  void i64(int64_t v) { put(&v, sizeof v); }
  void bytes(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  void keys(const std::vector<std::string>& ks) {
    u32(static_cast<uint32_t>(ks.size()));
    for (const auto& k : ks) bytes(k);
  }

  // Starts a frame: reserves the length, writes the opcode (or status) and request id.
  void begin_frame(uint8_t code, uint32_t request_id) {
    frame_start_ = out_.size();
    u32(0);
    u8(code);
    u32(request_id);
  }
  // Patches the length of the frame begun last.
  void end_frame() {
    const uint32_t body = static_cast<uint32_t>(out_.size() - frame_start_ - 4);
    std::memcpy(&out_[frame_start_], &body, sizeof body);
  }

 private:
  void put(const void* p, std::size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string& out_;
  std::size_t frame_start_ = 0;
};

// ---- decoding ---------------------------------------------------------------------------------
// Reads fields from a byte range. Every read is bounds-checked: on underflow the reader turns
// !ok() and every later read yields zero/empty, so a handler decodes all fields, then checks ok()
// and done() once.
class Reader {
 public:
  Reader(const char* data, std::size_t size) : p_(data), end_(data + size) {}
  explicit Reader(std::string_view s) : Reader(s.data(), s.size()) {}

  bool ok() const { return ok_; }
  // True when every byte was consumed and nothing under-ran.
  bool done() const { return ok_ && p_ == end_; }
  std::size_t remaining() const { return static_cast<std::size_t>(end_ - p_); }

  uint8_t u8() { return get<uint8_t>(); }
  uint32_t u32() { return get<uint32_t>(); }
  uint64_t u64() { return get<uint64_t>(); }
  int64_t i64() { return get<int64_t>(); }

  // A length-prefixed byte string, refused (reader fails) when longer than max_len.
  std::string_view bytes(std::size_t max_len) {
    const uint32_t n = u32();
    if (!ok_ || n > max_len || n > remaining()) return fail_view();
    std::string_view v(p_, n);
    p_ += n;
    return v;
  }
  // A count (u32) refused when over max_count or when it cannot fit the remaining bytes
  // (each element needs at least min_elem_bytes), so no allocation trusts a declared count.
  uint32_t count(std::size_t max_count, std::size_t min_elem_bytes) {
    const uint32_t n = u32();
    if (!ok_ || n > max_count || (min_elem_bytes && n > remaining() / min_elem_bytes)) {
      ok_ = false;
      return 0;
    }
    return n;
  }

 private:
  template <typename T>
  T get() {
    T v{};
    if (!ok_ || remaining() < sizeof(T)) {
      ok_ = false;
      return v;
    }
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string_view fail_view() {
    ok_ = false;
    return {};
  }
  const char* p_;
  const char* end_;
  bool ok_ = true;
};

// The header of a frame at the front of a buffer, when all of it has arrived.
struct FrameHeader {
  uint32_t body_len = 0;  // bytes after the length field
  uint8_t code = 0;       // opcode (requests) or status (replies)
  uint32_t request_id = 0;
  std::size_t total() const { return 4 + static_cast<std::size_t>(body_len); }
  std::size_t payload_len() const { return body_len - kMinFrameBody; }
};

enum class FrameParse { NeedMore, Ready, TooLarge, Malformed };

// Peeks at a frame at the front of [data, data+size) without consuming anything.
// Ready: the whole frame is there; NeedMore: wait for more bytes; TooLarge/Malformed: close.
inline FrameParse peek_frame(const char* data, std::size_t size, std::size_t max_frame_bytes,
                             FrameHeader* out) {
  if (size < 4) return FrameParse::NeedMore;
  uint32_t body = 0;
  std::memcpy(&body, data, 4);
  if (body < kMinFrameBody) return FrameParse::Malformed;
  if (body > max_frame_bytes) return FrameParse::TooLarge;
  if (size < 4 + static_cast<std::size_t>(body)) return FrameParse::NeedMore;
  out->body_len = body;
  out->code = static_cast<uint8_t>(data[4]);
  std::memcpy(&out->request_id, data + 5, 4);
  return FrameParse::Ready;
}

}  // namespace elasticstore
