// The native codec's replies to finished blocking requests (Completions), sized before they are
// built: over kMaxReplyBytes a TOO_LARGE reply, over the room left the connection closes.
#include <cstdint>
#include <string_view>

#include "server/codec.hpp"
#include "wire/protocol.hpp"

namespace elasticstore {
namespace {

class Reply {
 public:
  Reply(std::string& out, Status s, uint32_t id) : w(out) { w.begin_frame(static_cast<uint8_t>(s), id); }
  ~Reply() { w.end_frame(); }
  Writer w;
};

std::string over(const char* what, std::size_t n, std::size_t limit) {
  return std::string(what) + " of " + std::to_string(n) + " over the limit of " +
         std::to_string(limit);
}

// The payload bytes of a completion's reply, or SIZE_MAX when a value it names is gone (only
// defensive: nothing deletes keys between a completion and its encoding).
constexpr std::size_t kGone = SIZE_MAX;
std::size_t keys_bytes(const std::vector<std::string>& ks) {
  std::size_t n = 4;
  for (const auto& k : ks) n += 4 + k.size();
  return n;
}
std::size_t payload_bytes(const Completion& c, const KvState& kv) {
  if (c.status == Status::Error || c.status == Status::TooLarge) return 4 + c.key.size();
  const bool ok = c.status == Status::Ok;
  switch (c.kind) {
    case WaitKind::Get: {
      if (!ok) return 0;
      const Entry* e = kv.find(c.key);
      return e ? 4 + e->value.size() + 8 : kGone;
    }
    case WaitKind::Wait: return ok ? 0 : keys_bytes(c.values);
    case WaitKind::MultiGet: {
      if (!ok) return keys_bytes(c.values);
      std::size_t n = 4;
      for (const auto& k : c.values) {  // totals first: nothing is copied for a refused reply
        const Entry* e = kv.find(k);
        if (!e) return kGone;
        n += 4 + e->value.size();
      }
      return n;
    }
    case WaitKind::QueuePop: return ok ? 4 + c.values.at(0).size() : 0;
    case WaitKind::Barrier: return 8;  // generation, or arrived + world_size
    case WaitKind::Watch: return (ok ? 1 + 4 + c.key.size() + 4 + c.value->size() : 0) + 8;
  }
  return 0;
}

// Appends the reply of a completion (payload_bytes() said it fits and all it names exists).
void encode_completion(const Completion& c, const KvState& kv, std::string& out) {
  const auto id = static_cast<uint32_t>(c.tag);
  if (c.status == Status::Error || c.status == Status::TooLarge) {
    Reply(out, c.status, id).w.bytes(c.key);
    return;
  }
  Reply rep(out, c.status, id);
  Writer& w = rep.w;
  const bool ok = c.status == Status::Ok;
  switch (c.kind) {
    case WaitKind::Get:
      if (ok) {
        const Entry* e = kv.find(c.key);
        w.bytes(e->value);
        w.u64(e->mod_revision);
      }
      break;
    case WaitKind::Wait:
      if (!ok) w.keys(c.values);
      break;
    case WaitKind::MultiGet:
      if (ok) {
        w.u32(static_cast<uint32_t>(c.values.size()));
        for (const auto& k : c.values) w.bytes(kv.find(k)->value);
      } else {
        w.keys(c.values);
      }
      break;
    case WaitKind::QueuePop:
      if (ok) w.bytes(c.values.at(0));
      break;
    case WaitKind::Barrier:
      if (ok) {
        w.u64(c.revision);
      } else {
        w.u32(c.arrived);
        w.u32(c.world_size);
      }
      break;
    case WaitKind::Watch:
      if (ok) {
        w.u8(static_cast<uint8_t>(c.event));
        w.bytes(c.key);
        w.bytes(*c.value);
      }
      w.u64(c.revision);  // the event's, the current (TIMEOUT) or the oldest held (COMPACTED)
      break;
  }
}

}  // namespace

// Over kMaxReplyBytes: TOO_LARGE (the peer asked for too much). Over `room`: no reply, close (the
// peer does not read what it asked for).
bool encode_native_completion(const Completion& c, const KvState& kv, std::string& out,
                              std::size_t room, std::string* reason) {
  const auto id = static_cast<uint32_t>(c.tag);
  const std::size_t payload = payload_bytes(c, kv);
  if (payload == kGone) {
    Reply(out, Status::Error, id).w.bytes("a key of the reply was deleted before it was sent");
    return true;
  }
  if (payload > kMaxReplyBytes) {
    Reply(out, Status::TooLarge, id).w.bytes(over("reply", payload, kMaxReplyBytes));
    return true;
  }
  if (kFrameHeaderBytes + payload > room) {
    *reason = "not reading its replies: a reply of " + std::to_string(payload) +
              " bytes does not fit the " + std::to_string(room) + " bytes left of its output limit";
    return false;
  }
  encode_completion(c, kv, out);
  return true;
}

}  // namespace elasticstore
