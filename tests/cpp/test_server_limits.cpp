// The server's configurable limits (ServerConfig), each hit over real loopback sockets: the
// request past it gets TOO_LARGE or its connection closes; other connections and stored data are
// unharmed.
#include <stdexcept>

#include "server_harness.hpp"

namespace {

Reply request(Sock& s, const std::string& f) {
  CHECK(s.send(f));
  return s.recv();
}
std::string message(const Reply& r) {
  Reader rd = r.reader();
  return std::string(rd.bytes(kMaxReplyBytes));
}
std::string try_get(Sock& s, const std::string& key) {
  Reply r = request(s, frame(Op::TryGet, 50, [&](Writer& w) { w.bytes(key); }));
  Reader rd = r.reader();
  if (!r.ok || r.status != 0 || rd.u8() != 1) return "<missing>";
  return std::string(rd.bytes(kMaxValueBytes));
}
std::string keys_frame(Op op, uint32_t id, std::size_t n, bool with_timeout) {
  return frame(op, id, [&](Writer& w) {
    w.u32(static_cast<uint32_t>(n));
    for (std::size_t i = 0; i < n; ++i) w.bytes("k" + std::to_string(i));
    if (with_timeout) w.u32(0);
  });
}
constexpr uint8_t kTooLarge = static_cast<uint8_t>(Status::TooLarge);

}  // namespace

TEST(configured_key_value_and_count_limits_answer_too_large) {
  ServerConfig cfg = quiet_config();
  cfg.limits.max_key_bytes = 16;
  cfg.limits.max_value_bytes = 100;
  cfg.limits.max_keys_per_request = 4;
  Server srv(cfg);
  srv.start();
  auto s = greeted(srv.port());
  CHECK_EQ(request(*s, set_frame(2, std::string(17, 'k'), "v")).status, kTooLarge);
  CHECK_EQ(request(*s, set_frame(3, "k", std::string(101, 'v'))).status, kTooLarge);
  CHECK_EQ(request(*s, keys_frame(Op::Check, 4, 5, false)).status, kTooLarge);
  CHECK_EQ(request(*s, keys_frame(Op::Check, 5, 4, false)).status, uint8_t{0});
  CHECK_EQ(request(*s, set_frame(6, std::string(16, 'k'), std::string(100, 'v'))).status, uint8_t{0});
  CHECK_EQ(try_get(*s, std::string(16, 'k')), std::string(100, 'v'));
  CHECK(ping_ok(*s, 1));
}

TEST(stored_keys_quota_refuses_new_keys_keeps_old_ones) {
  ServerConfig cfg = quiet_config();
  cfg.limits.max_stored_keys = 3;
  Server srv(cfg);
  srv.start();
  auto s = greeted(srv.port());
  for (const char* k : {"a", "b", "c"}) CHECK_EQ(request(*s, set_frame(2, k, "1")).status, uint8_t{0});
  Reply r = request(*s, set_frame(3, "d", "1"));
  CHECK_EQ(r.status, kTooLarge);
  CHECK(message(r).find("store full") != std::string::npos);
  CHECK_EQ(request(*s, frame(Op::Add, 4, [](Writer& w) { w.bytes("e"); w.i64(1); })).status, kTooLarge);
  CHECK_EQ(request(*s, frame(Op::QueuePush, 5, [](Writer& w) { w.bytes("q"); w.bytes("x"); })).status,
           kTooLarge);
  CHECK_EQ(request(*s, frame(Op::MultiSet, 6, [](Writer& w) {
             w.u32(2); w.bytes("a"); w.bytes("2"); w.bytes("z"); w.bytes("2");
           })).status, kTooLarge);
  // Replacing a stored key is no growth in keys; nothing stored was lost.
  CHECK_EQ(request(*s, set_frame(7, "a", "9")).status, uint8_t{0});
  CHECK_EQ(try_get(*s, "a"), std::string("9"));
  CHECK_EQ(try_get(*s, "b"), std::string("1"));
  CHECK_EQ(try_get(*s, "z"), std::string("<missing>"));
  // Deleting frees room.
  CHECK_EQ(request(*s, frame(Op::DeleteKey, 8, [](Writer& w) { w.bytes("c"); })).status, uint8_t{0});
  CHECK_EQ(request(*s, set_frame(9, "d", "1")).status, uint8_t{0});
}

TEST(stored_bytes_quota_counts_keys_values_and_queued_items) {
  ServerConfig cfg = quiet_config();
  cfg.limits.max_stored_bytes = 100;
  Server srv(cfg);
  srv.start();
  auto s = greeted(srv.port());
  CHECK_EQ(request(*s, set_frame(2, "big", std::string(90, 'v'))).status, uint8_t{0});  // 93 bytes
  CHECK_EQ(request(*s, set_frame(3, "k", std::string(10, 'v'))).status, kTooLarge);
  CHECK_EQ(request(*s, frame(Op::Append, 4, [](Writer& w) { w.bytes("big"); w.bytes("12345678"); })).status,
           kTooLarge);
  CHECK_EQ(request(*s, frame(Op::CompareSet, 5, [](Writer& w) {
             w.bytes("big"); w.bytes(std::string(90, 'v')); w.bytes(std::string(98, 'w')); w.u8(0);
           })).status, kTooLarge);
  CHECK_EQ(try_get(*s, "big"), std::string(90, 'v'));
  CHECK_EQ(request(*s, frame(Op::QueuePush, 6, [](Writer& w) { w.bytes("q"); w.bytes("1234"); })).status,
           uint8_t{0});  // 98 bytes
  CHECK_EQ(request(*s, frame(Op::QueuePush, 7, [](Writer& w) { w.bytes("q"); w.bytes("1234"); })).status,
           kTooLarge);
  // A shrinking replace always fits.
  CHECK_EQ(request(*s, set_frame(8, "big", "small")).status, uint8_t{0});
  CHECK_EQ(request(*s, set_frame(9, "k", std::string(10, 'v'))).status, uint8_t{0});
}

TEST(connections_per_peer_refuses_the_extra_accept) {
  ServerConfig cfg = quiet_config();
  cfg.max_connections_per_peer = 2;
  Server srv(cfg);
  srv.start();
  auto a = greeted(srv.port());
  auto b = greeted(srv.port());
  Sock c(srv.port());
  CHECK(c.closed_by_peer());
  CHECK(ping_ok(*a, 1));
  CHECK_EQ(stat(srv, "connections_refused"), 1ull);
  b.reset();  // the count follows closes
  const auto deadline = Clock::now() + std::chrono::milliseconds(kWaitMs);
  while (stat(srv, "connections") > 1 && Clock::now() < deadline) ::usleep(1000);
  auto d = greeted(srv.port());
  CHECK(ping_ok(*d, 2));
}

TEST(waiters_per_connection_answers_too_large) {
  ServerConfig cfg = quiet_config();
  cfg.limits.max_waiters_per_connection = 2;
  Server srv(cfg);
  srv.start();
  auto s = greeted(srv.port());
  auto other = greeted(srv.port());
  CHECK(s->send(get_frame(2, "x", kNoTimeout) + get_frame(3, "y", kNoTimeout)));
  Reply r = request(*s, get_frame(4, "z", kNoTimeout));
  CHECK(r.ok && r.id == 4 && r.status == kTooLarge);
  CHECK(message(r).find("max_waiters_per_connection") != std::string::npos);
  CHECK(ping_ok(*s, 1));
  // The parked ones still complete; another connection has its own allowance.
  CHECK(other->send(get_frame(5, "w", kNoTimeout)));
  CHECK_EQ(request(*other, set_frame(6, "x", "1")).status, uint8_t{0});
  Reply woken = s->recv();
  CHECK(woken.ok && woken.id == 2 && woken.status == 0);
}

TEST(handshake_timeout_closes_silent_and_half_greeted_connections) {
  ServerConfig cfg = quiet_config();
  cfg.handshake_timeout_ms = 150;
  Server srv(cfg);
  srv.start();
  auto good = greeted(srv.port());
  Sock silent(srv.port());
  Sock preamble_only(srv.port());
  CHECK(preamble_only.send(std::string(kNativePreamble, kPreambleBytes)));
  CHECK(silent.closed_by_peer());
  CHECK(preamble_only.closed_by_peer());
  CHECK(!good->readable_within(300));  // greeted connections are never timed out by it
  CHECK(ping_ok(*good, 1));
  CHECK_EQ(stat(srv, "connections_closed_bad_input"), 2ull);
}

TEST(connection_buffer_limit_closes_the_connection_that_does_not_read) {
  ServerConfig cfg = quiet_config();
  cfg.max_connection_buffer_bytes = 2 * 1024 * 1024;
  Server srv(cfg);
  srv.start();
  auto writer = greeted(srv.port());
  auto sleeper = greeted(srv.port());
  std::string gets;
  constexpr uint32_t kGets = 24;  // 24 MiB of replies, more than the kernel's socket buffers
  for (uint32_t i = 0; i < kGets; ++i) gets += get_frame(10 + i, "w", kNoTimeout);
  CHECK(sleeper->send(gets));
  const auto deadline = Clock::now() + std::chrono::milliseconds(kWaitMs);
  while (stat(srv, "waiters") < kGets && Clock::now() < deadline) ::usleep(1000);
  CHECK_EQ(stat(srv, "waiters"), uint64_t{kGets});
  CHECK_EQ(request(*writer, set_frame(2, "w", std::string(1024 * 1024, 'x'))).status, uint8_t{0});
  CHECK(sleeper->closed_by_peer());
  CHECK(ping_ok(*writer, 3));
  CHECK_EQ(try_get(*writer, "w").size(), std::size_t{1024 * 1024});
}

TEST(out_of_range_config_is_refused_naming_the_field) {
  ServerConfig cfg = quiet_config();
  cfg.limits.max_value_bytes = kMaxValueBytes + 1;
  bool thrown = false;
  try {
    Server srv(cfg);
  } catch (const std::invalid_argument& e) {
    thrown = std::string(e.what()).find("max_value_bytes") != std::string::npos;
  }
  CHECK(thrown);
}

namespace {
// The message of the std::invalid_argument validate_config() throws for `cfg` ("" when none).
std::string refusal(const ServerConfig& cfg) {
  try {
    validate_config(cfg);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}
}  // namespace

TEST(keepalive_config_whole_seconds_zero_is_off_and_the_bound) {
  ServerConfig cfg = quiet_config();
  CHECK(keepalive_enabled(cfg));
  CHECK_EQ(keepalive_bound_ms(cfg), uint64_t{kKeepaliveIdleMs} + uint64_t{kKeepaliveIntervalMs} * kKeepaliveCount);
  CHECK_EQ(keepalive_bound_ms(cfg), uint64_t{16'000});
  CHECK_EQ(refusal(cfg), std::string());
  cfg.keepalive_idle_ms = 1000;
  cfg.keepalive_interval_ms = 1000;
  cfg.keepalive_count = 2;
  CHECK_EQ(keepalive_bound_ms(cfg), uint64_t{3000});
  for (int which = 0; which < 3; ++which) {  // any of the three 0: off, and valid
    ServerConfig off = cfg;
    (which == 0 ? off.keepalive_idle_ms : which == 1 ? off.keepalive_interval_ms : off.keepalive_count) = 0;
    CHECK(!keepalive_enabled(off));
    CHECK_EQ(keepalive_bound_ms(off), uint64_t{0});
    CHECK_EQ(refusal(off), std::string());
  }
  cfg.keepalive_idle_ms = kKeepaliveMaxMs;
  cfg.keepalive_interval_ms = kKeepaliveMaxMs;
  cfg.keepalive_count = kKeepaliveMaxCount;
  CHECK_EQ(refusal(cfg), std::string());  // the kernel's ceilings are accepted

  ServerConfig bad = quiet_config();
  bad.keepalive_interval_ms = 500;  // the kernel counts whole seconds
  CHECK(contains(refusal(bad), "keepalive_interval_ms = 500") && contains(refusal(bad), "whole number of seconds"));
  bad = quiet_config();
  bad.keepalive_idle_ms = kKeepaliveMaxMs + 1000;
  CHECK(contains(refusal(bad), "keepalive_idle_ms"));
  bad = quiet_config();
  bad.keepalive_count = kKeepaliveMaxCount + 1;
  CHECK(contains(refusal(bad), "keepalive_count = 128") && contains(refusal(bad), "0 (off)"));
  bool thrown = false;
  try {
    Server srv(bad);
  } catch (const std::invalid_argument& e) {
    thrown = contains(e.what(), "keepalive_count");
  }
  CHECK(thrown);
}
