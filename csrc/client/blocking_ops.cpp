// The client's operations that block server-side until a condition holds or their timeout
// passes (a TIMEOUT reply carries what was missing): encode the request, decode the reply.
#include "client/client.hpp"

#include <cstdint>
#include <string>
#include <utility>

#include "client/ops.hpp"

namespace elasticstore {
using namespace client_detail;

std::string Client::get(std::string_view key, Timeout timeout) {
  check_key(Op::Get, key);
  const Call call = start_call(Op::Get);
  const uint32_t t = wire_timeout(timeout);
  Writer w = begin_locked(Op::Get, key);
  w.bytes(key);
  w.u32(t);
  const auto start = Clock::now();
  const Reply r = exchange_locked(w, Op::Get, t);
  Reader rd(r.payload);
  if (r.status == static_cast<uint8_t>(Status::Timeout)) {
    finish_locked(rd, Op::Get);
    throw TimeoutError("get reached its timeout after " + fmt_seconds(seconds(Clock::now() - start)) +
                       " waiting for key " + quote(key));
  }
  expect_ok_locked(r, Op::Get, [&] { return quote(key); });
  std::string value(rd.bytes(kMaxReplyField));
  rd.u64();  // mod_revision
  finish_locked(rd, Op::Get);
  return value;
}

// WAIT and MULTI_GET: sends the keys and turns a TIMEOUT reply into a TimeoutError naming the
// keys still missing. Returns the OK reply, whose payload the caller decodes.
Client::Reply Client::wait_for_keys_locked(Op op, const std::vector<std::string>& keys,
                                           Timeout timeout) {
  const uint32_t t = wire_timeout(timeout);
  Writer w = begin_locked(op, keys);
  w.keys(keys);
  w.u32(t);
  const auto start = Clock::now();
  Reply r = exchange_locked(w, op, t);
  if (r.status == static_cast<uint8_t>(Status::Timeout)) {
    Reader rd(r.payload);
    std::vector<std::string> missing;
    read_keys(rd, &missing);
    finish_locked(rd, op);
    throw TimeoutError(lower_op(op) + " reached its timeout after " +
                       fmt_seconds(seconds(Clock::now() - start)) + " for keys " +
                       quote_list(keys) + " (missing: " + quote_list(missing) + ")");
  }
  expect_ok_locked(r, op, [&] { return quote_list(keys); });
  return r;
}

void Client::wait(const std::vector<std::string>& keys, Timeout timeout) {
  check_keys(Op::Wait, keys);
  if (keys.empty()) {
    check_not_closed();
    return;
  }
  const Call call = start_call(Op::Wait);
  const Reply r = wait_for_keys_locked(Op::Wait, keys, timeout);
  finish_locked(Reader(r.payload), Op::Wait);
}

std::vector<std::string> Client::multi_get(const std::vector<std::string>& keys,
                                           Timeout timeout) {
  check_keys(Op::MultiGet, keys);
  if (keys.empty()) {
    check_not_closed();
    return {};
  }
  const Call call = start_call(Op::MultiGet);
  const Reply r = wait_for_keys_locked(Op::MultiGet, keys, timeout);
  Reader rd(r.payload);
  const uint32_t n = rd.count(kMaxKeysPerRequest, 4);
  std::vector<std::string> values;
  values.reserve(n);
  for (uint32_t i = 0; i < n && rd.ok(); ++i) values.emplace_back(rd.bytes(kMaxReplyField));
  finish_locked(rd, Op::MultiGet);
  if (values.size() != keys.size()) {
    fail_protocol_locked("MULTI_GET returned " + std::to_string(values.size()) +
                         " values for " + std::to_string(keys.size()) + " keys");
  }
  return values;
}

std::optional<std::string> Client::queue_pop(std::string_view queue, Timeout timeout) {
  check_key(Op::QueuePop, queue);
  const Call call = start_call(Op::QueuePop);
  const uint32_t t = wire_timeout(timeout);
  Writer w = begin_locked(Op::QueuePop, Subject(queue, "queue "));
  w.bytes(queue);
  w.u32(t);
  const auto start = Clock::now();
  const Reply r = exchange_locked(w, Op::QueuePop, t);
  Reader rd(r.payload);
  if (r.status == static_cast<uint8_t>(Status::Timeout)) {
    finish_locked(rd, Op::QueuePop);
    if (t == 0) return std::nullopt;
    throw TimeoutError("queue_pop reached its timeout after " + fmt_seconds(seconds(Clock::now() - start)) +
                       " waiting on queue " + quote(queue));
  }
  expect_ok_locked(r, Op::QueuePop, [&] { return "queue " + quote(queue); });
  std::string value(rd.bytes(kMaxReplyField));
  finish_locked(rd, Op::QueuePop);
  return value;
}

uint64_t Client::barrier(std::string_view key, int64_t world_size, Timeout timeout) {
  check_key(Op::Barrier, key);
  if (world_size < 1 || static_cast<uint64_t>(world_size) > UINT32_MAX) {
    throw StoreError("barrier " + quote(key) + ": world_size must be in [1, " +
                     std::to_string(UINT32_MAX) + "], got " + std::to_string(world_size));
  }
  const Call call = start_call(Op::Barrier);
  const uint32_t t = wire_timeout(timeout);
  Writer w = begin_locked(Op::Barrier, key);
  w.bytes(key);
  w.u32(static_cast<uint32_t>(world_size));
  w.u32(t);
  const auto start = Clock::now();
  const Reply r = exchange_locked(w, Op::Barrier, t);
  Reader rd(r.payload);
  if (r.status == static_cast<uint8_t>(Status::Timeout)) {
    const uint32_t arrived = rd.u32();
    const uint32_t size = rd.u32();
    finish_locked(rd, Op::Barrier);
    throw TimeoutError("barrier " + quote(key) + " reached its timeout after " +
                       fmt_seconds(seconds(Clock::now() - start)) + " (arrived " +
                       std::to_string(arrived) + "/" + std::to_string(size) + ")");
  }
  expect_ok_locked(r, Op::Barrier, [&] { return quote(key); });
  const uint64_t generation = rd.u64();
  finish_locked(rd, Op::Barrier);
  return generation;
}

WatchEvent Client::watch(std::string_view key, std::optional<uint64_t> after_revision,
                         Timeout timeout, bool prefix) {
  check_key(Op::Watch, key);
  const Call call = start_call(Op::Watch);
  const uint32_t t = wire_timeout(timeout);
  const uint64_t after = after_revision ? *after_revision : kWatchFromNow;
  Writer w = begin_locked(Op::Watch, Subject(key, prefix ? "prefix " : ""));
  w.bytes(key);
  w.u8(prefix ? 1 : 0);
  w.u64(after);
  w.u32(t);
  const auto start = Clock::now();
  const Reply r = exchange_locked(w, Op::Watch, t);
  auto subject = [&] { return (prefix ? "prefix " : "key ") + quote(key); };
  auto since = [&] {
    return after_revision ? "after revision " + std::to_string(after) : std::string("from now");
  };
  Reader rd(r.payload);
  if (r.status == static_cast<uint8_t>(Status::Timeout)) {
    const uint64_t current = rd.u64();
    finish_locked(rd, Op::Watch);
    throw TimeoutError("watch reached its timeout after " + fmt_seconds(seconds(Clock::now() - start)) +
                       " for " + subject() + ": no change " + since() + " (current revision " +
                       std::to_string(current) + ")");
  }
  if (r.status == static_cast<uint8_t>(Status::Compacted)) {
    const uint64_t oldest = rd.u64();
    finish_locked(rd, Op::Watch);
    throw CompactedError("watch " + subject() + ": changes " + since() +
                             " were compacted from the history; the oldest revision held is " +
                             std::to_string(oldest),
                         oldest);
  }
  expect_ok_locked(r, Op::Watch, subject);
  WatchEvent ev;
  const uint8_t kind = rd.u8();
  ev.key = std::string(rd.bytes(kMaxReplyField));
  ev.value = std::string(rd.bytes(kMaxReplyField));
  ev.revision = rd.u64();
  finish_locked(rd, Op::Watch);
  if (kind != static_cast<uint8_t>(EventKind::Set) &&
      kind != static_cast<uint8_t>(EventKind::Delete)) {
    fail_protocol_locked("WATCH returned event kind " + std::to_string(kind));
  }
  ev.kind = static_cast<EventKind>(kind);
  return ev;
}

}  // namespace elasticstore
