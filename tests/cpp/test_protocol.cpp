// Codec tests: Writer/Reader round trips, bounds checks, and transactional frame peeking.
#include <string>
#include <vector>

#include "check.hpp"
#include "wire/protocol.hpp"

using namespace elasticstore;

TEST(round_trip_all_field_types) {
  std::string out;
  Writer w(out);
  w.u8(7);
  w.u32(0xDEADBEEF);
  w.u64(0x0102030405060708ull);
  w.i64(-42);
  w.bytes("hello");
  w.keys({"a", "", "ccc"});
  Reader r(out);
  CHECK_EQ(r.u8(), uint8_t{7});
  CHECK_EQ(r.u32(), 0xDEADBEEFu);
  CHECK_EQ(r.u64(), 0x0102030405060708ull);
  CHECK_EQ(r.i64(), int64_t{-42});
  CHECK_EQ(r.bytes(16), std::string_view("hello"));
  const uint32_t n = r.count(10, 4);
  CHECK_EQ(n, 3u);
  CHECK_EQ(r.bytes(16), std::string_view("a"));
  CHECK_EQ(r.bytes(16), std::string_view(""));
  CHECK_EQ(r.bytes(16), std::string_view("ccc"));
  CHECK(r.done());
}

TEST(little_endian_on_the_wire) {
  std::string out;
  Writer(out).u32(0x01020304);
  CHECK_EQ(out, std::string("\x04\x03\x02\x01", 4));
}

TEST(underflow_fails_and_yields_zero) {
  std::string out;
  Writer(out).u32(5);
  Reader r(out.data(), 3);
  CHECK_EQ(r.u32(), 0u);
  CHECK(!r.ok());
  CHECK(!r.done());
  CHECK_EQ(r.u64(), 0ull);  // every later read yields zero
  CHECK(r.bytes(10).empty());
}

TEST(bytes_longer_than_remaining_fail) {
  std::string out;
  Writer w(out);
  w.u32(10);
  out += "abc";
  Reader r(out);
  CHECK(r.bytes(100).empty());
  CHECK(!r.ok());
}

TEST(leftover_bytes_are_not_done) {
  std::string out;
  Writer(out).u64(1);
  Reader r(out);
  r.u32();
  CHECK(r.ok());
  CHECK(!r.done());
}

TEST(over_limit_bytes_refused) {
  std::string out;
  Writer(out).bytes(std::string(kMaxKeyBytes + 1, 'k'));
  Reader r(out);
  CHECK(r.bytes(kMaxKeyBytes).empty());
  CHECK(!r.ok());
  Reader r2(out);
  CHECK_EQ(r2.bytes(kMaxKeyBytes + 1).size(), kMaxKeyBytes + 1);
  CHECK(r2.done());
}

TEST(over_limit_count_refused) {
  std::string out;
  Writer w(out);
  w.u32(static_cast<uint32_t>(kMaxKeysPerRequest + 1));
  out.append((kMaxKeysPerRequest + 1) * 4, '\0');
  Reader r(out);
  CHECK_EQ(r.count(kMaxKeysPerRequest, 4), 0u);
  CHECK(!r.ok());
  // A count that cannot fit the remaining bytes is refused before anything trusts it.
  std::string small;
  Writer(small).u32(1000);
  small.append(8, '\0');
  Reader r2(small);
  CHECK_EQ(r2.count(kMaxKeysPerRequest, 4), 0u);
  CHECK(!r2.ok());
}

std::string frame(uint8_t op, uint32_t id, const std::string& payload) {
  std::string out;
  Writer w(out);
  w.begin_frame(op, id);
  out += payload;
  w.end_frame();
  return out;
}

TEST(frame_header_layout) {
  const std::string f = frame(static_cast<uint8_t>(Op::Ping), 0x11223344, std::string(8, 'x'));
  CHECK_EQ(f.size(), kFrameHeaderBytes + 8);
  FrameHeader h;
  CHECK(peek_frame(f.data(), f.size(), kMaxFrameBytes, &h) == FrameParse::Ready);
  CHECK_EQ(h.body_len, uint32_t{13});
  CHECK_EQ(h.code, static_cast<uint8_t>(Op::Ping));
  CHECK_EQ(h.request_id, 0x11223344u);
  CHECK_EQ(h.total(), f.size());
  CHECK_EQ(h.payload_len(), std::size_t{8});
}

TEST(peek_frame_byte_by_byte) {
  std::string two = frame(2, 1, "abc") + frame(3, 2, "");
  const std::size_t first = kFrameHeaderBytes + 3;
  FrameHeader h;
  for (std::size_t n = 0; n < first; ++n)
    CHECK(peek_frame(two.data(), n, kMaxFrameBytes, &h) == FrameParse::NeedMore);
  for (std::size_t n = first; n <= two.size(); ++n) {
    CHECK(peek_frame(two.data(), n, kMaxFrameBytes, &h) == FrameParse::Ready);
    CHECK_EQ(h.total(), first);  // only the first frame is reported, nothing consumed
  }
  const char* rest = two.data() + first;
  for (std::size_t n = 0; n < kFrameHeaderBytes; ++n)
    CHECK(peek_frame(rest, n, kMaxFrameBytes, &h) == FrameParse::NeedMore);
  CHECK(peek_frame(rest, kFrameHeaderBytes, kMaxFrameBytes, &h) == FrameParse::Ready);
  CHECK_EQ(h.request_id, 2u);
}

TEST(peek_frame_too_large_before_body_arrives) {
  std::string f;
  Writer(f).u32(static_cast<uint32_t>(kMaxFrameBytes + 1));
  FrameHeader h;
  CHECK(peek_frame(f.data(), 3, kMaxFrameBytes, &h) == FrameParse::NeedMore);
  CHECK(peek_frame(f.data(), 4, kMaxFrameBytes, &h) == FrameParse::TooLarge);
  std::string ok;
  Writer(ok).u32(static_cast<uint32_t>(kMaxFrameBytes));
  CHECK(peek_frame(ok.data(), 4, kMaxFrameBytes, &h) == FrameParse::NeedMore);
}

TEST(peek_frame_malformed_short_body) {
  for (uint32_t body = 0; body < kMinFrameBody; ++body) {
    std::string f;
    Writer(f).u32(body);
    f.append(16, '\0');
    FrameHeader h;
    CHECK(peek_frame(f.data(), f.size(), kMaxFrameBytes, &h) == FrameParse::Malformed);
  }
}

TEST(names) {
  CHECK_EQ(std::string(op_name(static_cast<uint8_t>(Op::CompareSet))), std::string("COMPARE_SET"));
  CHECK_EQ(std::string(op_name(99)), std::string("UNKNOWN"));
  CHECK_EQ(std::string(status_name(static_cast<uint8_t>(Status::Compacted))), std::string("COMPACTED"));
}

TEST(op_table) {
  CHECK_EQ(static_cast<std::size_t>(kMaxOp), sizeof kOps / sizeof kOps[0]);
  CHECK(op_info(0) == nullptr);
  CHECK(op_info(kMaxOp + 1) == nullptr);
  for (uint8_t code = 1; code <= kMaxOp; ++code) {
    const OpInfo* info = op_info(code);
    CHECK(info != nullptr);
    CHECK_EQ(static_cast<uint8_t>(info->op), code);
    CHECK_EQ(std::string(op_name(code)), std::string(info->wire_name));
  }
  CHECK_EQ(std::string(op_info(static_cast<uint8_t>(Op::Hello))->call_name), std::string("connect"));
  CHECK_EQ(std::string(op_info(static_cast<uint8_t>(Op::MultiGet))->call_name), std::string("multi_get"));
  CHECK(op_info(static_cast<uint8_t>(Op::Auth))->kind == OpKind::Auth);
  CHECK_EQ(std::string(op_kind_name(OpKind::Store)), std::string("store"));
}
