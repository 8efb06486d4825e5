#include "server/codec.hpp"

#include <cstdint>
#include <string_view>

#include "wire/auth.hpp"
#include "wire/protocol.hpp"

namespace elasticstore {
namespace {

enum class Outcome { Replied, Malformed };

struct Request {
  CommandContext& ctx;
  uint32_t id;
  Reader r;
};

using Handler = Outcome (*)(Request&);

// Writes one reply frame; the length is patched when the scope ends.
class Reply {
 public:
  Reply(std::string& out, Status s, uint32_t id) : w(out) { w.begin_frame(static_cast<uint8_t>(s), id); }
  ~Reply() { w.end_frame(); }
  Writer w;
};

Outcome refuse(Request& q, Status s, const std::string& msg) {
  Reply(q.ctx.out, s, q.id).w.bytes(msg);
  return Outcome::Replied;
}

std::string over(const char* what, std::size_t n, std::size_t limit) {
  return std::string(what) + " of " + std::to_string(n) + " over the limit of " +
         std::to_string(limit);
}

// Fields are read with the frame as their only bound so that an oversized key or value gets a
// TOO_LARGE reply (the frame is well-formed) rather than a closed connection.
std::string_view field(Reader& r) { return r.bytes(kMaxFrameBytes); }

const StoreLimits& limits(Request& q) { return q.ctx.kv.limits(); }

bool key_too_large(Request& q, std::string_view key) {
  if (key.size() <= limits(q).max_key_bytes) return false;
  refuse(q, Status::TooLarge, over("key", key.size(), limits(q).max_key_bytes));
  return true;
}
bool value_too_large(Request& q, std::string_view value) {
  if (value.size() <= limits(q).max_value_bytes) return false;
  refuse(q, Status::TooLarge, over("value", value.size(), limits(q).max_value_bytes));
  return true;
}
// Refuses a write the store has no room for (max_stored_keys / max_stored_bytes) with TOO_LARGE.
bool store_full(Request& q, bool fits, const std::string& why) {
  if (fits) return false;
  refuse(q, Status::TooLarge, why);
  return true;
}
// The longest decimal int64 ADD stores.
constexpr std::size_t kMaxCounterBytes = 20;

// Reads `keys`; a count or key over its limit is reported in *too_large (the rest still parsed, so
// that a malformed frame is still recognised) and nothing over the limit is stored.
void read_keys(const StoreLimits& lim, Reader& r, std::vector<std::string_view>* keys,
               std::string* too_large) {
  const uint32_t n = r.count(UINT32_MAX, 4);
  if (n > lim.max_keys_per_request) *too_large = over("key count", n, lim.max_keys_per_request);
  else keys->reserve(n);
  for (uint32_t i = 0; i < n && r.ok(); ++i) {
    std::string_view k = field(r);
    if (k.size() > lim.max_key_bytes && too_large->empty())
      *too_large = over("key", k.size(), lim.max_key_bytes);
    if (too_large->empty()) keys->push_back(k);
  }
}

Outcome op_set(Request& q) {
  auto key = field(q.r);
  auto value = field(q.r);
  const uint8_t flags = q.r.u8();
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, key) || value_too_large(q, value)) return Outcome::Replied;
  std::string why;
  if (store_full(q, q.ctx.kv.fits(key, value.size(), &why), why)) return Outcome::Replied;
  const uint64_t rev = q.ctx.kv.set(q.ctx.conn, key, value, flags & kFlagEphemeral);
  Reply(q.ctx.out, Status::Ok, q.id).w.u64(rev);
  return Outcome::Replied;
}

Outcome op_get(Request& q) {
  auto key = field(q.r);
  const uint32_t timeout = q.r.u32();
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, key)) return Outcome::Replied;
  q.ctx.kv.get(q.ctx.conn, q.id, key, timeout);
  return Outcome::Replied;
}

Outcome op_try_get(Request& q) {
  auto key = field(q.r);
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, key)) return Outcome::Replied;
  const Entry* e = q.ctx.kv.find(key);
  Reply rep(q.ctx.out, Status::Ok, q.id);
  rep.w.u8(e ? 1 : 0);
  rep.w.bytes(e ? std::string_view(e->value) : std::string_view());
  rep.w.u64(e ? e->mod_revision : 0);
  return Outcome::Replied;
}

Outcome op_add(Request& q) {
  auto key = field(q.r);
  const int64_t delta = q.r.i64();
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, key)) return Outcome::Replied;
  std::string why;
  if (store_full(q, q.ctx.kv.fits(key, kMaxCounterBytes, &why), why)) return Outcome::Replied;
  int64_t v = 0;
  if (q.ctx.kv.add(key, delta, &v) != Status::Ok)
    return refuse(q, Status::WrongType, "ADD: the value is not a decimal int64, or overflowed");
  Reply(q.ctx.out, Status::Ok, q.id).w.i64(v);
  return Outcome::Replied;
}

Outcome op_compare_set(Request& q) {
  auto key = field(q.r);
  auto expected = field(q.r);
  auto desired = field(q.r);
  const uint8_t flags = q.r.u8();
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, key) || value_too_large(q, expected) || value_too_large(q, desired))
    return Outcome::Replied;
  const Entry* e = q.ctx.kv.find(key);
  std::string why;
  const bool swaps = e ? e->value == expected : expected.empty();
  if (swaps && store_full(q, q.ctx.kv.fits(key, desired.size(), &why), why)) return Outcome::Replied;
  const CasResult r = q.ctx.kv.compare_set(q.ctx.conn, key, expected, desired, flags & kFlagEphemeral);
  Reply rep(q.ctx.out, Status::Ok, q.id);
  rep.w.u8(r.swapped);
  rep.w.u8(r.exists);
  rep.w.bytes(r.current);
  return Outcome::Replied;
}

Outcome wait_like(Request& q, WaitKind kind) {
  std::vector<std::string_view> keys;
  std::string too_large;
  read_keys(limits(q), q.r, &keys, &too_large);
  const uint32_t timeout = q.r.u32();
  if (!q.r.done()) return Outcome::Malformed;
  if (!too_large.empty()) return refuse(q, Status::TooLarge, too_large);
  q.ctx.kv.wait(q.ctx.conn, q.id, keys, timeout, kind);
  return Outcome::Replied;
}
Outcome op_wait(Request& q) { return wait_like(q, WaitKind::Wait); }
Outcome op_multi_get(Request& q) { return wait_like(q, WaitKind::MultiGet); }

Outcome op_check(Request& q) {
  std::vector<std::string_view> keys;
  std::string too_large;
  read_keys(limits(q), q.r, &keys, &too_large);
  if (!q.r.done()) return Outcome::Malformed;
  if (!too_large.empty()) return refuse(q, Status::TooLarge, too_large);
  Reply(q.ctx.out, Status::Ok, q.id).w.u8(q.ctx.kv.check(keys) ? 1 : 0);
  return Outcome::Replied;
}

Outcome op_delete_key(Request& q) {
  auto key = field(q.r);
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, key)) return Outcome::Replied;
  Reply(q.ctx.out, Status::Ok, q.id).w.u8(q.ctx.kv.erase(key) ? 1 : 0);
  return Outcome::Replied;
}

Outcome op_num_keys(Request& q) {
  if (!q.r.done()) return Outcome::Malformed;
  Reply(q.ctx.out, Status::Ok, q.id).w.i64(static_cast<int64_t>(q.ctx.kv.num_keys()));
  return Outcome::Replied;
}

Outcome op_list_keys(Request& q) {
  auto prefix = field(q.r);
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, prefix)) return Outcome::Replied;
  const std::vector<const std::string*> keys = q.ctx.kv.list_keys(prefix);
  std::size_t bytes = 4;
  for (const std::string* k : keys) bytes += 4 + k->size();
  if (bytes > kMaxReplyBytes) return refuse(q, Status::TooLarge, over("reply", bytes, kMaxReplyBytes));
  Reply rep(q.ctx.out, Status::Ok, q.id);
  rep.w.u32(static_cast<uint32_t>(keys.size()));
  for (const std::string* k : keys) rep.w.bytes(*k);
  return Outcome::Replied;
}

Outcome op_append(Request& q) {
  auto key = field(q.r);
  auto value = field(q.r);
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, key) || value_too_large(q, value)) return Outcome::Replied;
  const Entry* e = q.ctx.kv.find(key);
  std::string why;
  if (store_full(q, q.ctx.kv.fits(key, (e ? e->value.size() : 0) + value.size(), &why), why))
    return Outcome::Replied;
  uint64_t rev = 0;
  if (q.ctx.kv.append(key, value, &rev) != Status::Ok)
    return refuse(q, Status::TooLarge, "APPEND: the value would exceed " +
                                           std::to_string(limits(q).max_value_bytes) + " bytes");
  Reply(q.ctx.out, Status::Ok, q.id).w.u64(rev);
  return Outcome::Replied;
}

Outcome op_multi_set(Request& q) {
  const uint32_t n = q.r.count(UINT32_MAX, 8);
  std::vector<std::pair<std::string_view, std::string_view>> kvs;
  std::string too_large;
  const StoreLimits& lim = limits(q);
  if (n > lim.max_keys_per_request) too_large = over("key count", n, lim.max_keys_per_request);
  for (uint32_t i = 0; i < n && q.r.ok(); ++i) {
    auto k = field(q.r);
    auto v = field(q.r);
    if (too_large.empty() && k.size() > lim.max_key_bytes) too_large = over("key", k.size(), lim.max_key_bytes);
    if (too_large.empty() && v.size() > lim.max_value_bytes)
      too_large = over("value", v.size(), lim.max_value_bytes);
    if (too_large.empty()) kvs.emplace_back(k, v);
  }
  if (!q.r.done()) return Outcome::Malformed;
  if (!too_large.empty()) return refuse(q, Status::TooLarge, too_large);  // all or nothing
  if (store_full(q, q.ctx.kv.fits_all(kvs, &too_large), too_large)) return Outcome::Replied;
  uint64_t rev = q.ctx.kv.revision();
  for (const auto& [k, v] : kvs) rev = q.ctx.kv.set(q.ctx.conn, k, v, false);
  Reply(q.ctx.out, Status::Ok, q.id).w.u64(rev);
  return Outcome::Replied;
}

Outcome op_queue_push(Request& q) {
  auto queue = field(q.r);
  auto value = field(q.r);
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, queue) || value_too_large(q, value)) return Outcome::Replied;
  std::string why;
  if (store_full(q, q.ctx.kv.fits_queue_item(queue, value.size(), &why), why)) return Outcome::Replied;
  Reply(q.ctx.out, Status::Ok, q.id).w.i64(q.ctx.kv.queue_push(queue, value));
  return Outcome::Replied;
}

Outcome op_queue_pop(Request& q) {
  auto queue = field(q.r);
  const uint32_t timeout = q.r.u32();
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, queue)) return Outcome::Replied;
  q.ctx.kv.queue_pop(q.ctx.conn, q.id, queue, timeout);
  return Outcome::Replied;
}

Outcome op_queue_len(Request& q) {
  auto queue = field(q.r);
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, queue)) return Outcome::Replied;
  Reply(q.ctx.out, Status::Ok, q.id).w.i64(q.ctx.kv.queue_len(queue));
  return Outcome::Replied;
}

Outcome op_ping(Request& q) {
  const uint64_t nonce = q.r.u64();
  if (!q.r.done()) return Outcome::Malformed;
  Reply(q.ctx.out, Status::Ok, q.id).w.u64(nonce);
  return Outcome::Replied;
}

Outcome op_barrier(Request& q) {
  auto key = field(q.r);
  const uint32_t world_size = q.r.u32();
  const uint32_t timeout = q.r.u32();
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, key)) return Outcome::Replied;
  q.ctx.kv.barrier(q.ctx.conn, q.id, key, world_size, timeout);
  return Outcome::Replied;
}

Outcome op_watch(Request& q) {
  auto key = field(q.r);
  const uint8_t is_prefix = q.r.u8();
  const uint64_t after = q.r.u64();
  const uint32_t timeout = q.r.u32();
  if (!q.r.done()) return Outcome::Malformed;
  if (key_too_large(q, key)) return Outcome::Replied;
  q.ctx.kv.watch(q.ctx.conn, q.id, key, is_prefix != 0, after, timeout);
  return Outcome::Replied;
}

Outcome op_stats(Request& q) {
  if (!q.r.done()) return Outcome::Malformed;
  const StatsList stats = q.ctx.stats.stats_snapshot();
  Reply rep(q.ctx.out, Status::Ok, q.id);
  rep.w.u32(static_cast<uint32_t>(stats.size()));
  for (const auto& [name, value] : stats) {
    rep.w.bytes(name);
    rep.w.u64(value);
  }
  return Outcome::Replied;
}

// ALLOW_PEERS: `keys` of addresses or CIDRs that may use torch's protocol (see auth.hpp). Only a
// greeted, hence authenticated when the server has a token, connection gets here.
Outcome op_allow_peers(Request& q) {
  const uint32_t n = q.r.count(kMaxAllowedPeers, 4);
  std::vector<std::string_view> addrs;
  addrs.reserve(n);
  for (uint32_t i = 0; i < n && q.r.ok(); ++i) addrs.push_back(q.r.bytes(kMaxCidrBytes));
  if (!q.r.done()) return Outcome::Malformed;
  std::string error;
  for (std::string_view a : addrs)
    if (!q.ctx.auth.allowed.add(a, &error)) return refuse(q, Status::Error, "ALLOW_PEERS: " + error);
  Reply(q.ctx.out, Status::Ok, q.id);
  return Outcome::Replied;
}

// Indexed by opcode (ops.def's handler column); 0 is no opcode.
constexpr Handler kHandlers[kMaxOp + 1] = {
    nullptr,
#define ELASTICSTORE_OP(Enum, code, wire_name, call_name, kind, handler) handler,
#include "wire/ops.def"
};


class NativeCodec final : public Codec {
 public:
  const char* name() const noexcept override { return "native"; }
  bool handshake_done() const noexcept override { return greeted_; }

  Step step(CommandContext& ctx, const char* data, std::size_t size, std::size_t* consumed,
            std::string* reason) override {
    FrameHeader h;
    switch (peek_frame(data, size, greeted_ ? kMaxFrameBytes : kMaxHandshakeFrameBytes, &h)) {
      case FrameParse::NeedMore: return Step::NeedMore;
      case FrameParse::TooLarge:
        *reason = greeted_ ? "frame over kMaxFrameBytes (" + std::to_string(kMaxFrameBytes) + ")"
                           : "handshake frame over kMaxHandshakeFrameBytes (" +
                                 std::to_string(kMaxHandshakeFrameBytes) + ")";
        return Step::Close;
      case FrameParse::Malformed:
        *reason = "malformed frame header (body shorter than 5 bytes)";
        return Step::Close;
      case FrameParse::Ready: break;
    }
    if (h.code == 0 || h.code > kMaxOp) {
      *reason = "unknown opcode " + std::to_string(h.code);
      return Step::Close;
    }
    Request q{ctx, h.request_id, Reader(data + kFrameHeaderBytes, h.payload_len())};
    *consumed = h.total();
    if (!greeted_) return handshake(q, static_cast<Op>(h.code), reason);
    if (kHandlers[h.code] == nullptr) {
      *reason = std::string(op_name(h.code)) + " after the handshake";
      return Step::Close;
    }
    if (kHandlers[h.code](q) == Outcome::Malformed) {
      *reason = std::string("malformed frame (opcode ") + op_name(h.code) + ")";
      return Step::Close;
    }
    *consumed = h.total();
    return Step::Handled;
  }

  bool complete(const Completion& c, const KvState& kv, std::string& out, std::size_t room,
                std::string* reason) override {
    return encode_native_completion(c, kv, out, room, reason);
  }

 private:
  // HELLO, then (when either side has a token) AUTH: ServerHandshake (auth.cpp). A refusal is
  // replied UNAUTHENTICATED and the connection closes once the reply is written (ReplyAndClose).
  Step handshake(Request& q, Op op, std::string* reason) {
    switch (handshake_.on_frame(q.ctx.auth, op, q.id, q.r, q.ctx.conn, q.ctx.out, reason)) {
      case HandshakeStep::Pending: return Step::Handled;
      case HandshakeStep::Greeted: greeted_ = true; return Step::Handled;
      case HandshakeStep::Refused: return Step::ReplyAndClose;
      case HandshakeStep::Close: return Step::Close;
    }
    return Step::Close;
  }

  bool greeted_ = false;
  ServerHandshake handshake_;
};

}  // namespace

std::unique_ptr<Codec> make_native_codec() { return std::make_unique<NativeCodec>(); }

}  // namespace elasticstore
