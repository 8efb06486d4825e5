// torch TCPStore request parsing: byte layouts checked against captures of torch 2.13's client.
#include <algorithm>
#include <string>

#include "check.hpp"
#include "wire/tcpstore_protocol.hpp"

using elasticstore::kMaxKeyBytes;
using elasticstore::kMaxKeysPerRequest;
using namespace elasticstore::tcpstore;

namespace {

std::string u64le(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }
std::string str(std::string_view s) { return u64le(s.size()) + std::string(s); }
std::string op(Op o) { return std::string(1, static_cast<char>(o)); }

Parse parse(const std::string& bytes, Request* req, std::string* reason = nullptr) {
  std::string ignored;
  return parse_request(bytes.data(), bytes.size(), req, reason ? reason : &ignored);
}

// Every proper prefix of a complete request must ask for more bytes, never fail.
bool needs_more_until_complete(const std::string& bytes) {
  Request req;
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    std::string ignored;
    if (parse_request(bytes.data(), n, &req, &ignored) != Parse::NeedMore) return false;
  }
  return parse(bytes, &req) == Parse::Ready && req.consumed == bytes.size();
}

}  // namespace

TEST(validate_and_ping_match_torch_bytes) {
  // Captured: torch sends 00 ce f7 85 3c, then 0d + its pid as u32.
  const std::string validate("\x00\xce\xf7\x85\x3c", 5);
  Request req;
  CHECK(parse(validate, &req) == Parse::Ready);
  CHECK(req.op == Op::Validate);
  CHECK_EQ(req.word, kValidationMagic);
  CHECK_EQ(req.consumed, std::size_t{5});
  const std::string ping("\x0d\xd2\x0c\x00\x00", 5);
  CHECK(parse(ping, &req) == Parse::Ready);
  CHECK(req.op == Op::Ping);
  CHECK_EQ(req.word, 0x0cd2u);
}

TEST(set_layout_matches_capture) {
  // Captured for set("a", "1"): 01, u64 2, "/a", u64 1, "1".
  const std::string bytes = op(Op::Set) + str("/a") + str("1");
  Request req;
  CHECK(parse(bytes, &req) == Parse::Ready);
  CHECK(req.keys.size() == 1 && req.keys[0] == "/a");
  CHECK(req.values.size() == 1 && req.values[0] == "1");
  CHECK(needs_more_until_complete(bytes));
}

TEST(compare_set_add_barrier) {
  Request req;  // the parsed views point into the request bytes: keep those alive
  const std::string cas = op(Op::CompareSet) + str("/a") + str("1") + str("x");
  CHECK(parse(cas, &req) == Parse::Ready);
  CHECK(req.values.size() == 2 && req.values[0] == "1" && req.values[1] == "x");
  const std::string add = op(Op::Add) + str("/n") + u64le(static_cast<uint64_t>(-3));
  CHECK(parse(add, &req) == Parse::Ready);
  CHECK_EQ(req.number, int64_t{-3});
  const std::string barrier = op(Op::Barrier) + str("/bk") + u64le(4);
  CHECK(parse(barrier, &req) == Parse::Ready);
  CHECK_EQ(req.number, int64_t{4});
}

TEST(multi_key_requests) {
  Request req;
  const std::string wait = op(Op::Wait) + u64le(2) + str("/b") + str("/c");
  CHECK(parse(wait, &req) == Parse::Ready);
  CHECK(req.keys.size() == 2 && req.keys[1] == "/c");
  CHECK(needs_more_until_complete(wait));
  const std::string mset = op(Op::MultiSet) + u64le(2) + str("/b") + str("2") + str("/c") + str("3");
  CHECK(parse(mset, &req) == Parse::Ready);
  CHECK(req.keys.size() == 2 && req.values.size() == 2 && req.values[1] == "3");
  CHECK(needs_more_until_complete(mset));
}

TEST(no_payload_requests) {
  Request req;
  for (Op o : {Op::GetNumKeys, Op::CancelWait, Op::ListKeys}) {
    CHECK(parse(op(o), &req) == Parse::Ready);
    CHECK_EQ(req.consumed, std::size_t{1});
  }
}

TEST(limits_fail_before_the_bytes_arrive) {
  Request req;
  std::string reason;
  // Only the declared length is there: a key over the limit is refused at once.
  CHECK(parse(op(Op::Get) + u64le(kMaxKeyBytes + 1), &req, &reason) == Parse::TooLarge);
  CHECK(reason.find("key") != std::string::npos);
  CHECK(parse(op(Op::Set) + str("/k") + u64le(~uint64_t{0}), &req, &reason) == Parse::TooLarge);
  CHECK(parse(op(Op::Wait) + u64le(kMaxKeysPerRequest + 1), &req, &reason) == Parse::TooLarge);
  CHECK(reason.find("WAIT") != std::string::npos);
  CHECK(parse(op(Op::Set) + str(std::string(kMaxKeyBytes, 'k')) + str("v"), &req) == Parse::Ready);
}

TEST(unknown_opcode) {
  Request req;
  std::string reason;
  CHECK(parse(std::string(1, '\x13'), &req, &reason) == Parse::UnknownOp);
  CHECK(reason.find("19") != std::string::npos);
  CHECK(parse(std::string(1, '\xff'), &req, &reason) == Parse::UnknownOp);
}

TEST(pipelined_requests_consume_one_at_a_time) {
  const std::string first = op(Op::Set) + str("/a") + str("1");
  const std::string both = first + op(Op::GetNumKeys);
  Request req;
  CHECK(parse(both, &req) == Parse::Ready);
  CHECK_EQ(req.consumed, first.size());
  std::string ignored;
  CHECK(parse_request(both.data() + req.consumed, both.size() - req.consumed, &req, &ignored) ==
        Parse::Ready);
  CHECK(req.op == Op::GetNumKeys);
}

namespace {
// Scans `bytes` handing them over `step` bytes at a time, as reads would; returns the result.
Parse scan_in_steps(const std::string& bytes, std::size_t step, std::size_t* length,
                    std::string* reason) {
  Scanner sc;
  Parse p = Parse::NeedMore;
  for (std::size_t n = std::min(step, bytes.size());; n = std::min(n + step, bytes.size())) {
    p = sc.scan(bytes.data(), n, reason);
    if (p != Parse::NeedMore || n == bytes.size()) break;
  }
  *length = sc.length();
  return p;
}
}  // namespace

TEST(scanner_finds_the_end_of_every_request_however_it_is_split) {
  const std::string requests[] = {
      std::string("\x00\xce\xf7\x85\x3c", 5),
      op(Op::Set) + str("/a") + str("1"),
      op(Op::CompareSet) + str("/a") + str("1") + str("x"),
      op(Op::Add) + str("/n") + u64le(3),
      op(Op::Wait) + u64le(2) + str("/b") + str("/c"),
      op(Op::MultiSet) + u64le(2) + str("/b") + str("2") + str("/c") + str("3"),
      op(Op::MultiGet) + u64le(0),
      op(Op::GetNumKeys),
  };
  for (const std::string& r : requests) {
    for (std::size_t step : {std::size_t{1}, std::size_t{3}, r.size()}) {
      std::size_t length = 0;
      std::string reason;
      CHECK(scan_in_steps(r + op(Op::Ping), step, &length, &reason) == Parse::Ready);
      CHECK_EQ(length, r.size());  // stops at the end of the first request
    }
    Scanner sc;  // every proper prefix asks for more
    std::string reason;
    for (std::size_t n = 0; n < r.size(); ++n) CHECK(sc.scan(r.data(), n, &reason) == Parse::NeedMore);
  }
}

TEST(scanner_refuses_a_request_declaring_more_than_the_limit_early) {
  using elasticstore::kMaxValueBytes;
  std::string reason;
  std::size_t length = 0;
  // Two 8 MiB values: refused when the second length arrives, none of the data needed.
  const std::string head = op(Op::MultiSet) + u64le(2) + str("/a") + u64le(kMaxValueBytes);
  Scanner sc;
  std::string bytes = head + std::string(kMaxValueBytes, 'v') + str("/b") + u64le(kMaxValueBytes);
  CHECK(sc.scan(bytes.data(), head.size(), &reason) == Parse::NeedMore);
  CHECK(sc.scan(bytes.data(), bytes.size(), &reason) == Parse::TooLarge);
  CHECK(reason.find("MULTI_SET") != std::string::npos);
  CHECK(reason.find(std::to_string(kMaxRequestBytes)) != std::string::npos);
  // A count whose keys could not fit, before any key.
  const std::string many = op(Op::MultiGet) + u64le(kMaxKeysPerRequest);
  CHECK(scan_in_steps(many, many.size(), &length, &reason) == Parse::NeedMore);
  const std::string max_pairs = op(Op::MultiSet) + u64le(kMaxKeysPerRequest);
  CHECK(scan_in_steps(max_pairs, max_pairs.size(), &length, &reason) == Parse::NeedMore);
  CHECK(scan_in_steps(op(Op::Get) + u64le(kMaxKeyBytes + 1), 64, &length, &reason) == Parse::TooLarge);
  CHECK(scan_in_steps(op(Op::Set) + str("/k") + u64le(~uint64_t{0}), 64, &length, &reason) ==
        Parse::TooLarge);
  CHECK(scan_in_steps(std::string(1, '\x13'), 1, &length, &reason) == Parse::UnknownOp);
  // One maximal value with a maximal key still fits.
  const std::string max_set =
      op(Op::Set) + str(std::string(kMaxKeyBytes, 'k')) + str(std::string(kMaxValueBytes, 'v'));
  CHECK(scan_in_steps(max_set, 1 << 16, &length, &reason) == Parse::Ready);
  CHECK_EQ(length, max_set.size());
}
