#include "wire/tcpstore_protocol.hpp"

#include <cstring>
#include <initializer_list>

namespace elasticstore::tcpstore {

const char* op_name(uint8_t op) {
  static constexpr const char* kNames[] = {
      "VALIDATE",  "SET",         "COMPARE_SET", "GET",        "ADD",       "CHECK",     "WAIT",
      "GETNUMKEYS", "DELETE_KEY", "APPEND",      "MULTI_GET",  "MULTI_SET", "CANCEL_WAIT",
      "PING",      "QUEUE_PUSH",  "QUEUE_POP",   "QUEUE_LEN",  "LIST_KEYS", "BARRIER"};
  return op <= kMaxOp ? kNames[op] : "UNKNOWN";
}

namespace {

// A cursor over the unconsumed bytes. Each read either succeeds, runs out of data (need_more),
// or fails a limit (fault with a reason); after the first miss every read is a no-op.
class Cursor {
 public:
  Cursor(const char* data, std::size_t size) : p_(data), end_(data + size) {}

  bool good() const { return !need_more_ && fault_ == Parse::Ready; }
  Parse result() const { return need_more_ ? Parse::NeedMore : fault_; }
  const std::string& reason() const { return reason_; }
  std::size_t offset(const char* start) const { return static_cast<std::size_t>(p_ - start); }

  template <typename T>
  T fixed() {
    T v{};
    if (!good()) return v;
    if (static_cast<std::size_t>(end_ - p_) < sizeof(T)) {
      need_more_ = true;
      return v;
    }
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }

  // A u64 length and that many bytes; the length is checked before waiting for the bytes.
  std::string_view string(std::size_t max_len, const char* what) {
    const uint64_t n = fixed<uint64_t>();
    if (!good()) return {};
    if (n > max_len) {
      fail(Parse::TooLarge, std::string(what) + " of " + std::to_string(n) + " bytes exceeds the limit of " +
                                std::to_string(max_len));
      return {};
    }
    if (static_cast<uint64_t>(end_ - p_) < n) {
      need_more_ = true;
      return {};
    }
    std::string_view v(p_, static_cast<std::size_t>(n));
    p_ += n;
    return v;
  }

  std::size_t count(std::size_t max_count) {
    const uint64_t n = fixed<uint64_t>();
    if (good() && n > max_count) {
      fail(Parse::TooLarge, "request names " + std::to_string(n) + " keys, over the limit of " +
                                std::to_string(max_count));
      return 0;
    }
    return static_cast<std::size_t>(n);
  }

  void fail(Parse kind, std::string reason) {
    fault_ = kind;
    reason_ = std::move(reason);
  }

 private:
  const char* p_;
  const char* end_;
  bool need_more_ = false;
  Parse fault_ = Parse::Ready;
  std::string reason_;
};

void read_keys(Cursor& c, Request* out) {
  const std::size_t n = c.count(kMaxKeysPerRequest);
  for (std::size_t i = 0; i < n && c.good(); ++i) out->keys.push_back(c.string(kMaxKeyBytes, "key"));
}

}  // namespace

Parse parse_request(const char* data, std::size_t size, Request* out, std::string* reason) {
  if (size == 0) return Parse::NeedMore;
  out->keys.clear();
  out->values.clear();
  out->number = 0;
  out->word = 0;
  const uint8_t code = static_cast<uint8_t>(data[0]);
  if (code > kMaxOp) {
    *reason = "unknown opcode " + std::to_string(code);
    return Parse::UnknownOp;
  }
  out->op = static_cast<Op>(code);
  Cursor c(data + 1, size - 1);
  auto key = [&] { out->keys.push_back(c.string(kMaxKeyBytes, "key")); };
  auto value = [&] { out->values.push_back(c.string(kMaxValueBytes, "value")); };

  switch (out->op) {
    case Op::Validate:
    case Op::Ping:
      out->word = c.fixed<uint32_t>();
      break;
    case Op::Set:
    case Op::Append:
    case Op::QueuePush:
      key();
      value();
      break;
    case Op::CompareSet:
      key();
      value();
      value();
      break;
    case Op::Get:
    case Op::DeleteKey:
    case Op::QueuePop:
    case Op::QueueLen:
      key();
      break;
    case Op::Add:
    case Op::Barrier:
      key();
      out->number = c.fixed<int64_t>();
      break;
    case Op::Check:
    case Op::Wait:
    case Op::MultiGet:
      read_keys(c, out);
      break;
    case Op::MultiSet: {
      const std::size_t n = c.count(kMaxKeysPerRequest);
      for (std::size_t i = 0; i < n && c.good(); ++i) {
        key();
        value();
      }
      break;
    }
    case Op::GetNumKeys:
    case Op::CancelWait:
    case Op::ListKeys:
      break;
  }
  if (!c.good()) {
    if (c.result() != Parse::NeedMore) *reason = std::string(op_name(code)) + ": " + c.reason();
    return c.result();
  }
  out->consumed = 1 + c.offset(data + 1);
  return Parse::Ready;
}

// The field after `fields_` scanned ones, from the opcode's layout (parse_request's, below).
Scanner::Field Scanner::next_field() const noexcept {
  auto fixed = [this](std::initializer_list<Field> layout) {
    return fields_ < layout.size() ? layout.begin()[fields_] : Field::None;
  };
  auto repeated = [this](uint64_t per_item, Field last) {  // u64 n, then n x (key[, value])
    if (fields_ == 0) return Field::Count;
    if (fields_ - 1 >= count_ * per_item) return Field::None;
    return (fields_ - 1) % per_item == per_item - 1 ? last : Field::Key;
  };
  switch (static_cast<Op>(op_)) {
    case Op::Validate:
    case Op::Ping: return fixed({Field::U32});
    case Op::Set:
    case Op::Append:
    case Op::QueuePush: return fixed({Field::Key, Field::Value});
    case Op::CompareSet: return fixed({Field::Key, Field::Value, Field::Value});
    case Op::Get:
    case Op::DeleteKey:
    case Op::QueuePop:
    case Op::QueueLen: return fixed({Field::Key});
    case Op::Add:
    case Op::Barrier: return fixed({Field::Key, Field::I64});
    case Op::Check:
    case Op::Wait:
    case Op::MultiGet: return repeated(1, Field::Key);
    case Op::MultiSet: return repeated(2, Field::Value);
    case Op::GetNumKeys:
    case Op::CancelWait:
    case Op::ListKeys: return Field::None;
  }
  return Field::None;
}

Parse Scanner::scan(const char* data, std::size_t size, std::string* reason) {
  auto too_large = [&](std::string why) {
    *reason = std::string(op_name(op_)) + ": " + why;
    return Parse::TooLarge;
  };
  if (pos_ == 0) {
    if (size == 0) return Parse::NeedMore;
    op_ = static_cast<uint8_t>(data[0]);
    if (op_ > kMaxOp) {
      *reason = "unknown opcode " + std::to_string(op_);
      return Parse::UnknownOp;
    }
    pos_ = 1;
  }
  for (Field f = next_field(); f != Field::None; f = next_field()) {
    const std::size_t have = size - pos_;
    if (f == Field::U32 || f == Field::I64) {
      const std::size_t n = f == Field::U32 ? 4 : 8;
      if (have < n) return Parse::NeedMore;
      pos_ += n;
      ++fields_;
      continue;
    }
    if (have < 8) return Parse::NeedMore;
    uint64_t n = 0;
    std::memcpy(&n, data + pos_, 8);
    if (f == Field::Count) {
      if (n > kMaxKeysPerRequest)
        return too_large("request names " + std::to_string(n) + " keys, over the limit of " +
                         std::to_string(kMaxKeysPerRequest));
      const uint64_t per_item = static_cast<Op>(op_) == Op::MultiSet ? 2 : 1;
      if (pos_ + 8 + n * per_item * 8 > kMaxRequestBytes)  // each key or value needs its length
        return too_large("request of at least " + std::to_string(pos_ + 8 + n * per_item * 8) +
                         " bytes, over the limit of " + std::to_string(kMaxRequestBytes));
      count_ = n;
      pos_ += 8;
      ++fields_;
      continue;
    }
    const bool key = f == Field::Key;
    const std::size_t max_len = key ? kMaxKeyBytes : kMaxValueBytes;
    if (n > max_len)
      return too_large(std::string(key ? "key" : "value") + " of " + std::to_string(n) +
                       " bytes exceeds the limit of " + std::to_string(max_len));
    if (pos_ + 8 + n > kMaxRequestBytes)
      return too_large("request of at least " + std::to_string(pos_ + 8 + n) +
                       " bytes, over the limit of " + std::to_string(kMaxRequestBytes));
    if (have - 8 < n) return Parse::NeedMore;  // the length is read again when more bytes come
    pos_ += 8 + static_cast<std::size_t>(n);
    ++fields_;
  }
  return Parse::Ready;
}

void put_u8(std::string& out, uint8_t v) { out.push_back(static_cast<char>(v)); }
void put_u32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }
void put_i64(std::string& out, int64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }
void put_bytes(std::string& out, std::string_view v) {
  const uint64_t n = v.size();
  out.append(reinterpret_cast<const char*>(&n), sizeof n);
  out.append(v.data(), v.size());
}

}  // namespace elasticstore::tcpstore
