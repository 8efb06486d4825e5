// The client's operations that never block server-side: encode the request, decode the reply.
#include "client/client.hpp"

#include <cstdint>
#include <string>
#include <utility>

#include "client/ops.hpp"

namespace elasticstore {
using namespace client_detail;

// ---- operations -------------------------------------------------------------------------------

uint64_t Client::set(std::string_view key, std::string_view value, bool ephemeral) {
  check_key(Op::Set, key);
  check_value(Op::Set, key, value);
  const Call call = start_call(Op::Set);
  Writer w = begin_locked(Op::Set, key);
  w.bytes(key);
  w.bytes(value);
  w.u8(ephemeral ? kFlagEphemeral : 0);
  const Reply r = exchange_locked(w, Op::Set, kNotBlocking);
  expect_ok_locked(r, Op::Set, [&] { return quote(key); });
  Reader rd(r.payload);
  const uint64_t revision = rd.u64();
  finish_locked(rd, Op::Set);
  return revision;
}

std::optional<std::pair<std::string, uint64_t>> Client::try_get(std::string_view key) {
  check_key(Op::TryGet, key);
  const Call call = start_call(Op::TryGet);
  Writer w = begin_locked(Op::TryGet, key);
  w.bytes(key);
  const Reply r = exchange_locked(w, Op::TryGet, kNotBlocking);
  expect_ok_locked(r, Op::TryGet, [&] { return quote(key); });
  Reader rd(r.payload);
  const bool found = rd.u8() != 0;
  std::string value(rd.bytes(kMaxReplyField));
  const uint64_t revision = rd.u64();
  finish_locked(rd, Op::TryGet);
  if (!found) return std::nullopt;
  return std::make_pair(std::move(value), revision);
}

int64_t Client::add(std::string_view key, int64_t delta) {
  check_key(Op::Add, key);
  const Call call = start_call(Op::Add);
  Writer w = begin_locked(Op::Add, key);
  w.bytes(key);
  w.i64(delta);
  const Reply r = exchange_locked(w, Op::Add, kNotBlocking);
  expect_ok_locked(r, Op::Add, [&] { return quote(key); });
  Reader rd(r.payload);
  const int64_t v = rd.i64();
  finish_locked(rd, Op::Add);
  return v;
}

CompareSetResult Client::compare_set(std::string_view key, std::string_view expected,
                                     std::string_view desired, bool ephemeral) {
  check_key(Op::CompareSet, key);
  check_value(Op::CompareSet, key, expected);
  check_value(Op::CompareSet, key, desired);
  const Call call = start_call(Op::CompareSet);
  Writer w = begin_locked(Op::CompareSet, key);
  w.bytes(key);
  w.bytes(expected);
  w.bytes(desired);
  w.u8(ephemeral ? kFlagEphemeral : 0);
  const Reply r = exchange_locked(w, Op::CompareSet, kNotBlocking);
  expect_ok_locked(r, Op::CompareSet, [&] { return quote(key); });
  Reader rd(r.payload);
  CompareSetResult out;
  out.swapped = rd.u8() != 0;
  out.exists = rd.u8() != 0;
  out.current = std::string(rd.bytes(kMaxReplyField));
  finish_locked(rd, Op::CompareSet);
  return out;
}

bool Client::check(const std::vector<std::string>& keys) {
  check_keys(Op::Check, keys);
  if (keys.empty()) {
    check_not_closed();
    return true;
  }
  const Call call = start_call(Op::Check);
  Writer w = begin_locked(Op::Check, keys);
  w.keys(keys);
  const Reply r = exchange_locked(w, Op::Check, kNotBlocking);
  expect_ok_locked(r, Op::Check, [&] { return quote_list(keys); });
  Reader rd(r.payload);
  const bool all = rd.u8() != 0;
  finish_locked(rd, Op::Check);
  return all;
}

bool Client::delete_key(std::string_view key) {
  check_key(Op::DeleteKey, key);
  const Call call = start_call(Op::DeleteKey);
  Writer w = begin_locked(Op::DeleteKey, key);
  w.bytes(key);
  const Reply r = exchange_locked(w, Op::DeleteKey, kNotBlocking);
  expect_ok_locked(r, Op::DeleteKey, [&] { return quote(key); });
  Reader rd(r.payload);
  const bool deleted = rd.u8() != 0;
  finish_locked(rd, Op::DeleteKey);
  return deleted;
}

int64_t Client::num_keys() {
  const Call call = start_call(Op::NumKeys);
  Writer w = begin_locked(Op::NumKeys);
  const Reply r = exchange_locked(w, Op::NumKeys, kNotBlocking);
  expect_ok_locked(r, Op::NumKeys, [] { return std::string(); });
  Reader rd(r.payload);
  const int64_t n = rd.i64();
  finish_locked(rd, Op::NumKeys);
  return n;
}

std::vector<std::string> Client::list_keys(std::string_view prefix) {
  check_key(Op::ListKeys, prefix);
  const Call call = start_call(Op::ListKeys);
  Writer w = begin_locked(Op::ListKeys, Subject(prefix, "prefix "));
  w.bytes(prefix);
  const Reply r = exchange_locked(w, Op::ListKeys, kNotBlocking);
  expect_ok_locked(r, Op::ListKeys, [&] { return "prefix " + quote(prefix); });
  Reader rd(r.payload);
  std::vector<std::string> keys;
  // The listing is bounded by the reply size, not by kMaxKeysPerRequest.
  const uint32_t n = rd.count(UINT32_MAX, 4);
  keys.reserve(n);
  for (uint32_t i = 0; i < n && rd.ok(); ++i) keys.emplace_back(rd.bytes(kMaxReplyField));
  finish_locked(rd, Op::ListKeys);
  return keys;
}

uint64_t Client::append(std::string_view key, std::string_view value) {
  check_key(Op::Append, key);
  check_value(Op::Append, key, value);
  const Call call = start_call(Op::Append);
  Writer w = begin_locked(Op::Append, key);
  w.bytes(key);
  w.bytes(value);
  const Reply r = exchange_locked(w, Op::Append, kNotBlocking);
  expect_ok_locked(r, Op::Append, [&] { return quote(key); });
  Reader rd(r.payload);
  const uint64_t revision = rd.u64();
  finish_locked(rd, Op::Append);
  return revision;
}

uint64_t Client::multi_set(const std::vector<std::string>& keys,
                           const std::vector<std::string>& values) {
  if (keys.size() != values.size()) {
    throw StoreError("multi_set: " + std::to_string(keys.size()) + " keys but " +
                     std::to_string(values.size()) + " values");
  }
  check_keys(Op::MultiSet, keys);
  for (std::size_t i = 0; i < keys.size(); ++i) check_value(Op::MultiSet, keys[i], values[i]);
  const Call call = start_call(Op::MultiSet);
  Writer w = begin_locked(Op::MultiSet, keys);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (std::size_t i = 0; i < keys.size(); ++i) {
    w.bytes(keys[i]);
    w.bytes(values[i]);
  }
  const Reply r = exchange_locked(w, Op::MultiSet, kNotBlocking);
  expect_ok_locked(r, Op::MultiSet, [&] { return quote_list(keys); });
  Reader rd(r.payload);
  const uint64_t revision = rd.u64();
  finish_locked(rd, Op::MultiSet);
  return revision;
}

int64_t Client::queue_push(std::string_view queue, std::string_view value) {
  check_key(Op::QueuePush, queue);
  check_value(Op::QueuePush, queue, value);
  const Call call = start_call(Op::QueuePush);
  Writer w = begin_locked(Op::QueuePush, Subject(queue, "queue "));
  w.bytes(queue);
  w.bytes(value);
  const Reply r = exchange_locked(w, Op::QueuePush, kNotBlocking);
  expect_ok_locked(r, Op::QueuePush, [&] { return "queue " + quote(queue); });
  Reader rd(r.payload);
  const int64_t n = rd.i64();
  finish_locked(rd, Op::QueuePush);
  return n;
}

int64_t Client::queue_len(std::string_view queue) {
  check_key(Op::QueueLen, queue);
  const Call call = start_call(Op::QueueLen);
  Writer w = begin_locked(Op::QueueLen, Subject(queue, "queue "));
  w.bytes(queue);
  const Reply r = exchange_locked(w, Op::QueueLen, kNotBlocking);
  expect_ok_locked(r, Op::QueueLen, [&] { return "queue " + quote(queue); });
  Reader rd(r.payload);
  const int64_t n = rd.i64();
  finish_locked(rd, Op::QueueLen);
  return n;
}

void Client::ping() {
  const Call call = start_call(Op::Ping);
  const uint64_t nonce = (static_cast<uint64_t>(rng_()) << 32) ^ rng_();
  Writer w = begin_locked(Op::Ping);
  w.u64(nonce);
  const Reply r = exchange_locked(w, Op::Ping, kNotBlocking);
  expect_ok_locked(r, Op::Ping, [] { return std::string(); });
  Reader rd(r.payload);
  const uint64_t echoed = rd.u64();
  finish_locked(rd, Op::Ping);
  if (echoed != nonce) fail_protocol_locked("PING echoed a different nonce");
}

void Client::allow_peers(const std::vector<std::string>& addrs) {
  const Call call = start_call(Op::AllowPeers);
  Writer w = begin_locked(Op::AllowPeers);
  w.keys(addrs);
  const Reply r = exchange_locked(w, Op::AllowPeers, kNotBlocking);
  expect_ok_locked(r, Op::AllowPeers, [] { return std::string(); });
  Reader rd(r.payload);
  finish_locked(rd, Op::AllowPeers);
}

std::vector<std::pair<std::string, uint64_t>> Client::stats() {
  const Call call = start_call(Op::Stats);
  Writer w = begin_locked(Op::Stats);
  const Reply r = exchange_locked(w, Op::Stats, kNotBlocking);
  expect_ok_locked(r, Op::Stats, [] { return std::string(); });
  Reader rd(r.payload);
  const uint32_t n = rd.count(UINT32_MAX, 4 + 8);
  std::vector<std::pair<std::string, uint64_t>> out;
  out.reserve(n);
  for (uint32_t i = 0; i < n && rd.ok(); ++i) {
    std::string name(rd.bytes(kMaxReplyField));
    const uint64_t v = rd.u64();
    out.emplace_back(std::move(name), v);
  }
  finish_locked(rd, Op::Stats);
  return out;
}

}  // namespace elasticstore
