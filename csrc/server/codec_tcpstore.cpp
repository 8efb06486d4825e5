// torch's TCPStore protocol over the same KvState and waiters as the native protocol, so torch's
// own TCPStore client (env://, torchrun's c10d rendezvous, PrefixStore) runs on this server.
//
// Key space: torch's client prefixes every key with "/"; one leading "/" is stripped on the way in
// and added back in LIST_KEYS, so torch's "/k" is the native key "k". Keys sent without the
// prefix (the client's "init/" connect counter) are stored as sent.
//
// Replies are strictly in request order (the protocol has no request ids). The only deferred
// replies are WAIT's and BARRIER's; torch's client sends nothing else while one is pending except
// CANCEL_WAIT. Where torch's protocol has no way to report an error (ADD on a non-integer value,
// a missing key in GET), the connection is closed with a logged reason instead of a made-up reply.
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/codec.hpp"
#include "wire/tcpstore_protocol.hpp"

namespace elasticstore {
namespace {

namespace ts = tcpstore;

constexpr uint8_t kStopWaiting = 0;    // WAIT/BARRIER released
constexpr uint8_t kWaitCanceled = 1;   // reply to CANCEL_WAIT
constexpr uint8_t kCheckReady = 0;
constexpr uint8_t kCheckNotReady = 1;

std::string_view native_key(std::string_view torch_key) {
  if (!torch_key.empty() && torch_key.front() == ts::kClientKeyPrefix.front()) torch_key.remove_prefix(1);
  return torch_key;
}

std::vector<std::string_view> native_keys(const std::vector<std::string_view>& torch_keys) {
  std::vector<std::string_view> out;
  out.reserve(torch_keys.size());
  for (auto k : torch_keys) out.push_back(native_key(k));
  return out;
}

class TcpStoreCodec final : public Codec {
 public:
  const char* name() const noexcept override { return "tcpstore"; }
  bool handshake_done() const noexcept override { return validated_; }

  Step step(CommandContext& ctx, const char* data, std::size_t size, std::size_t* consumed,
            std::string* reason) override {
    switch (scanner_.scan(data, size, reason)) {  // resumes where the last call stopped
      case ts::Parse::NeedMore: return Step::NeedMore;
      case ts::Parse::Malformed:
      case ts::Parse::TooLarge:
      case ts::Parse::UnknownOp: return Step::Close;
      case ts::Parse::Ready: break;
    }
    const std::size_t length = scanner_.length();
    scanner_.reset();
    if (ts::parse_request(data, length, &req_, reason) != ts::Parse::Ready) {  // all there: once
      if (reason->empty()) *reason = "request shorter than its scan";
      return Step::Close;
    }
    if (!within_limits(ctx.kv.limits(), reason)) return Step::Close;
    if (!validated_ && req_.op != ts::Op::Validate) {
      *reason = std::string("torch client sent ") + ts::op_name(static_cast<uint8_t>(req_.op)) +
                " before VALIDATE";
      return Step::Close;
    }
    if (!handle(ctx, reason)) return Step::Close;
    *consumed = req_.consumed;
    return Step::Handled;
  }

  bool complete(const Completion& c, const KvState&, std::string& out, std::size_t room,
                std::string* reason) override {
    if (c.status != Status::Ok) {
      *reason = "torch client: " + std::string(status_name(static_cast<uint8_t>(c.status))) +
                (c.key.empty() ? std::string() : ": " + c.key);
      return false;
    }
    if (room < 1) {
      *reason = "not reading its replies: unsent output at its limit";
      return false;
    }
    ts::put_u8(out, kStopWaiting);  // WAIT and BARRIER are the only deferred ops
    return true;
  }

 private:
  // The server's configured key, value and count limits (the scanner enforces the compiled
  // ceilings); torch's protocol has no error reply, so going past one closes the connection.
  bool within_limits(const StoreLimits& lim, std::string* reason) const {
    if (req_.keys.size() > lim.max_keys_per_request)
      return fail(reason, "torch client: " + std::to_string(req_.keys.size()) +
                              " keys in one request, over the limit of " +
                              std::to_string(lim.max_keys_per_request));
    for (auto k : req_.keys)
      if (native_key(k).size() > lim.max_key_bytes)
        return fail(reason, "torch client: a key of " + std::to_string(k.size()) +
                                " bytes, over the limit of " + std::to_string(lim.max_key_bytes));
    for (auto v : req_.values)
      if (v.size() > lim.max_value_bytes)
        return fail(reason, "torch client: a value of " + std::to_string(v.size()) +
                                " bytes, over the limit of " + std::to_string(lim.max_value_bytes));
    return true;
  }
  // Whether the write req_ asks for fits the store's quota (max_stored_*); torch's protocol has no
  // error reply, so a write that does not closes the connection (nothing stored changes).
  bool fits_quota(const KvState& kv, std::string* reason) const {
    const std::string_view key = req_.keys.empty() ? std::string_view() : native_key(req_.keys[0]);
    std::string why;
    bool ok = true;
    switch (req_.op) {
      case ts::Op::Set: ok = kv.fits(key, req_.values[0].size(), &why); break;
      case ts::Op::Add: ok = kv.fits(key, 20, &why); break;
      case ts::Op::CompareSet: {
        const Entry* e = kv.find(key);
        if (e ? e->value == req_.values[0] : req_.values[0].empty())
          ok = kv.fits(key, req_.values[1].size(), &why);
        break;
      }
      case ts::Op::Append: {
        const Entry* e = kv.find(key);
        ok = kv.fits(key, (e ? e->value.size() : 0) + req_.values[0].size(), &why);
        break;
      }
      case ts::Op::MultiSet: {
        std::vector<std::pair<std::string_view, std::string_view>> kvs;
        for (std::size_t i = 0; i < req_.keys.size(); ++i)
          kvs.emplace_back(native_key(req_.keys[i]), req_.values[i]);
        ok = kv.fits_all(kvs, &why);
        break;
      }
      case ts::Op::QueuePush: ok = kv.fits_queue_item(key, req_.values[0].size(), &why); break;
      default: break;
    }
    return ok || fail(reason, "torch client: " + why);
  }

  // Serves req_; false closes the connection with *reason.
  bool handle(CommandContext& ctx, std::string* reason) {
    KvState& kv = ctx.kv;
    std::string& out = ctx.out;
    const std::string_view key = req_.keys.empty() ? std::string_view() : native_key(req_.keys[0]);
    if (!fits_quota(kv, reason)) return false;
    switch (req_.op) {
      case ts::Op::Validate:
        if (req_.word != ts::kValidationMagic) {
          *reason = "torch client VALIDATE with a wrong magic number";
          return false;
        }
        validated_ = true;
        return true;
      case ts::Op::Ping:
        ts::put_u32(out, req_.word);
        return true;
      case ts::Op::Set:
        kv.set(ctx.conn, key, req_.values[0], false);
        return true;
      case ts::Op::CompareSet: {
        const CasResult r = kv.compare_set(ctx.conn, key, req_.values[0], req_.values[1], false);
        ts::put_bytes(out, r.exists ? std::string_view(r.current) : req_.values[0]);
        return true;
      }
      case ts::Op::Get: {
        const Entry* e = kv.find(key);
        if (e) {
          ts::put_bytes(out, e->value);
        } else if (kv.queue_len(key) > 0) {
          ts::put_bytes(out, {});  // WAIT passed on the queue: torch's server answers empty
        } else {
          return fail(reason, "GET of missing key \"" + std::string(key) + "\"");
        }
        return true;
      }
      case ts::Op::Add: {
        int64_t v = 0;
        if (kv.add(key, req_.number, &v) != Status::Ok)
          return fail(reason, "ADD on key \"" + std::string(key) +
                                  "\" whose value is not a decimal int64 (or overflowed)");
        ts::put_i64(out, v);
        return true;
      }
      case ts::Op::Check:
        ts::put_u8(out, kv.check(native_keys(req_.keys)) ? kCheckReady : kCheckNotReady);
        return true;
      case ts::Op::Wait:
        kv.wait(ctx.conn, ++tag_, native_keys(req_.keys), kNoTimeout, WaitKind::Wait);
        return true;
      case ts::Op::GetNumKeys:
        ts::put_i64(out, static_cast<int64_t>(kv.num_keys()));
        return true;
      case ts::Op::DeleteKey:
        ts::put_i64(out, kv.erase(key) ? 1 : 0);
        return true;
      case ts::Op::Append: {
        uint64_t rev = 0;
        if (kv.append(key, req_.values[0], &rev) != Status::Ok)
          return fail(reason, "APPEND would grow key \"" + std::string(key) + "\" past " +
                                  std::to_string(kv.limits().max_value_bytes) + " bytes");
        return true;
      }
      case ts::Op::MultiGet: return multi_get(kv, out, reason);
      case ts::Op::MultiSet:
        for (std::size_t i = 0; i < req_.keys.size(); ++i)
          kv.set(ctx.conn, native_key(req_.keys[i]), req_.values[i], false);
        return true;
      case ts::Op::CancelWait:
        kv.cancel_waiters(ctx.conn);
        ts::put_u8(out, kWaitCanceled);
        return true;
      case ts::Op::QueuePush:
        kv.queue_push(key, req_.values[0]);
        return true;
      case ts::Op::QueuePop: {
        const int64_t before = kv.queue_len(key);
        ts::put_i64(out, before);
        if (before > 0) {
          std::string item;
          kv.queue_try_pop(key, &item);
          ts::put_bytes(out, item);
        }
        return true;
      }
      case ts::Op::QueueLen:
        ts::put_i64(out, kv.queue_len(key));
        return true;
      case ts::Op::ListKeys: return list_keys(kv, out, reason);
      case ts::Op::Barrier:
        if (req_.number < 1 || req_.number > UINT32_MAX)
          return fail(reason, "BARRIER with world size " + std::to_string(req_.number));
        kv.barrier(ctx.conn, ++tag_, key, static_cast<uint32_t>(req_.number), kNoTimeout);
        return true;
    }
    return fail(reason, "unhandled opcode");
  }

  bool multi_get(KvState& kv, std::string& out, std::string* reason) {
    std::size_t bytes = 0;
    std::vector<const Entry*> found;  // nullptr: a name only a non-empty queue holds
    found.reserve(req_.keys.size());
    for (auto k : req_.keys) {
      const Entry* e = kv.find(native_key(k));
      if (!e && kv.queue_len(native_key(k)) == 0)
        return fail(reason, "MULTI_GET of missing key \"" + std::string(native_key(k)) + "\"");
      bytes += 8 + (e ? e->value.size() : 0);
      found.push_back(e);
    }
    if (bytes > kMaxReplyBytes)
      return fail(reason, "MULTI_GET reply of " + std::to_string(bytes) + " bytes over the limit");
    for (const Entry* e : found) ts::put_bytes(out, e ? std::string_view(e->value) : std::string_view());
    return true;
  }

  // The reply is totalled first; over kMaxReplyBytes the connection closes (no error reply).
  bool list_keys(KvState& kv, std::string& out, std::string* reason) {
    const std::vector<const std::string*> keys = kv.list_keys("");
    std::size_t shown = 0, bytes = 8;
    for (const std::string* k : keys) {
      if (*k == ts::kInitKey) continue;
      ++shown;
      bytes += 8 + ts::kClientKeyPrefix.size() + k->size();
    }
    if (bytes > kMaxReplyBytes)
      return fail(reason, "LIST_KEYS reply of " + std::to_string(bytes) + " bytes over the limit");
    ts::put_i64(out, static_cast<int64_t>(shown));
    std::string prefixed;
    for (const std::string* k : keys) {
      if (*k == ts::kInitKey) continue;
      prefixed.assign(ts::kClientKeyPrefix).append(*k);
      ts::put_bytes(out, prefixed);
    }
    return true;
  }

  static bool fail(std::string* reason, std::string why) {
    *reason = std::move(why);
    return false;
  }

  ts::Scanner scanner_;
  ts::Request req_;
  uint64_t tag_ = 0;
  bool validated_ = false;
};

}  // namespace

std::unique_ptr<Codec> make_tcpstore_codec() { return std::make_unique<TcpStoreCodec>(); }

}  // namespace elasticstore
