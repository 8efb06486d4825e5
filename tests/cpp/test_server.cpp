// The server end to end over real loopback sockets, with hand-encoded frames. Every wait is
// bounded by a poll() deadline.
#include "server_harness.hpp"

TEST(hello_set_get) {
  Server srv(quiet_config());
  srv.start();
  CHECK(srv.running());
  CHECK_EQ(srv.host(), std::string("127.0.0.1"));
  CHECK(srv.port() != 0);
  auto s = std::make_unique<Sock>(srv.port());
  s->send(std::string(kNativePreamble, kPreambleBytes) + hello_frame(5));
  Reply h = s->recv();
  CHECK(h.ok);
  CHECK_EQ(h.id, 5u);
  Reader hr = h.reader();
  CHECK_EQ(hr.u32(), kProtocolVersion);
  CHECK(hr.u64() != 0);
  CHECK(hr.bytes(64).empty());  // no server nonce: the server has no token
  CHECK(hr.done());
  // Pipelined: both replies arrive, in order.
  s->send(set_frame(2, "k", "v") + get_frame(3, "k", 0));
  Reply a = s->recv(), b = s->recv();
  CHECK_EQ(a.id, 2u);
  CHECK_EQ(a.reader().u64(), 1ull);
  CHECK_EQ(b.id, 3u);
  CHECK_EQ(b.status, uint8_t{0});
  Reader br = b.reader();
  CHECK_EQ(br.bytes(100), std::string_view("v"));
  CHECK_EQ(br.u64(), 1ull);
}

TEST(blocking_get_answered_by_another_socket) {
  Server srv(quiet_config());
  srv.start();
  auto a = greeted(srv.port());
  auto b = greeted(srv.port());
  a->send(get_frame(10, "late", kNoTimeout));
  CHECK(!a->readable_within(50));  // nothing yet: the GET is parked server-side
  b->send(set_frame(1, "late", "here"));
  CHECK(b->recv().ok);
  Reply r = a->recv();
  CHECK(r.ok);
  CHECK_EQ(r.id, 10u);
  CHECK_EQ(r.status, uint8_t{0});
  CHECK_EQ(r.reader().bytes(100), std::string_view("here"));
}

TEST(get_times_out) {
  Server srv(quiet_config());
  srv.start();
  auto a = greeted(srv.port());
  const auto t0 = Clock::now();
  a->send(get_frame(4, "never", 100));
  Reply r = a->recv();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  CHECK(r.ok);
  CHECK_EQ(r.status, static_cast<uint8_t>(Status::Timeout));
  CHECK(r.payload.empty());
  CHECK(ms >= 90);
  CHECK(ms < 2000);
  CHECK_EQ(stat(srv, "waiters"), 0ull);
}

TEST(out_of_order_replies_by_request_id) {
  Server srv(quiet_config());
  srv.start();
  auto a = greeted(srv.port());
  auto b = greeted(srv.port());
  a->send(get_frame(1, "x", kWaitMs) + ping_frame(2, 99));
  Reply first = a->recv();
  CHECK_EQ(first.id, 2u);
  b->send(set_frame(1, "x", "1"));
  Reply second = a->recv();
  CHECK_EQ(second.id, 1u);
  CHECK_EQ(second.status, uint8_t{0});
}

// Every opcode's reply layout, decoded field by field with done() checks.
TEST(every_opcode_round_trip) {
  Server srv(quiet_config());
  srv.start();
  auto a = greeted(srv.port());
  auto call = [&](Op op, const std::function<void(Writer&)>& body) {
    a->send(frame(op, 100, body));
    Reply r = a->recv();
    CHECK(r.ok);
    CHECK_EQ(r.id, 100u);
    return r;
  };
  Reply r = call(Op::Add, [](Writer& w) { w.bytes("n"); w.i64(-3); });
  CHECK_EQ(r.reader().i64(), int64_t{-3});
  r = call(Op::Set, [](Writer& w) { w.bytes("s"); w.bytes("text"); w.u8(0); });
  r = call(Op::Add, [](Writer& w) { w.bytes("s"); w.i64(1); });
  CHECK_EQ(r.status, static_cast<uint8_t>(Status::WrongType));
  r = call(Op::TryGet, [](Writer& w) { w.bytes("n"); });
  { Reader x = r.reader(); CHECK_EQ(x.u8(), uint8_t{1}); CHECK_EQ(x.bytes(10), std::string_view("-3")); CHECK_EQ(x.u64(), 1ull); CHECK(x.done()); }
  r = call(Op::CompareSet, [](Writer& w) { w.bytes("n"); w.bytes("-3"); w.bytes("7"); w.u8(0); });
  { Reader x = r.reader(); CHECK_EQ(x.u8(), uint8_t{1}); CHECK_EQ(x.u8(), uint8_t{1}); CHECK_EQ(x.bytes(10), std::string_view("7")); CHECK(x.done()); }
  r = call(Op::Wait, [](Writer& w) { w.keys({"n", "m1"}); w.u32(0); });
  CHECK_EQ(r.status, static_cast<uint8_t>(Status::Timeout));
  { Reader x = r.reader(); CHECK_EQ(x.count(10, 4), 1u); CHECK_EQ(x.bytes(10), std::string_view("m1")); CHECK(x.done()); }
  r = call(Op::Check, [](Writer& w) { w.keys({"n", "s"}); });
  CHECK_EQ(r.reader().u8(), uint8_t{1});
  r = call(Op::Append, [](Writer& w) { w.bytes("s"); w.bytes("+"); });
  CHECK_EQ(r.reader().u64(), 4ull);
  r = call(Op::MultiGet, [](Writer& w) { w.keys({"s", "n"}); w.u32(0); });
  { Reader x = r.reader(); CHECK_EQ(x.u32(), 2u); CHECK_EQ(x.bytes(10), std::string_view("text+")); CHECK_EQ(x.bytes(10), std::string_view("7")); CHECK(x.done()); }
  r = call(Op::MultiSet, [](Writer& w) { w.u32(2); w.bytes("m/1"); w.bytes("a"); w.bytes("m/2"); w.bytes("b"); });
  CHECK_EQ(r.reader().u64(), 6ull);
  r = call(Op::ListKeys, [](Writer& w) { w.bytes("m/"); });
  { Reader x = r.reader(); CHECK_EQ(x.count(10, 4), 2u); CHECK_EQ(x.bytes(10), std::string_view("m/1")); CHECK_EQ(x.bytes(10), std::string_view("m/2")); CHECK(x.done()); }
  r = call(Op::NumKeys, {});
  CHECK_EQ(r.reader().i64(), int64_t{4});
  r = call(Op::DeleteKey, [](Writer& w) { w.bytes("m/1"); });
  CHECK_EQ(r.reader().u8(), uint8_t{1});
  r = call(Op::QueuePush, [](Writer& w) { w.bytes("q"); w.bytes("job"); });
  CHECK_EQ(r.reader().i64(), int64_t{1});
  r = call(Op::QueueLen, [](Writer& w) { w.bytes("q"); });
  CHECK_EQ(r.reader().i64(), int64_t{1});
  r = call(Op::QueuePop, [](Writer& w) { w.bytes("q"); w.u32(0); });
  CHECK_EQ(r.reader().bytes(10), std::string_view("job"));
  r = call(Op::QueuePop, [](Writer& w) { w.bytes("q"); w.u32(0); });
  CHECK_EQ(r.status, static_cast<uint8_t>(Status::Timeout));
  r = call(Op::Watch, [](Writer& w) { w.bytes("m/"); w.u8(1); w.u64(0); w.u32(0); });
  { Reader x = r.reader(); CHECK_EQ(x.u8(), uint8_t{1}); CHECK_EQ(x.bytes(10), std::string_view("m/1")); CHECK_EQ(x.bytes(10), std::string_view("a")); CHECK_EQ(x.u64(), 5ull); CHECK(x.done()); }
  r = call(Op::Watch, [](Writer& w) { w.bytes("zzz"); w.u8(0); w.u64(kWatchFromNow); w.u32(0); });
  CHECK_EQ(r.status, static_cast<uint8_t>(Status::Timeout));
  CHECK_EQ(r.reader().u64(), 7ull);
  r = call(Op::Barrier, [](Writer& w) { w.bytes("b"); w.u32(2); w.u32(0); });
  CHECK_EQ(r.status, static_cast<uint8_t>(Status::Timeout));
  { Reader x = r.reader(); CHECK_EQ(x.u32(), 1u); CHECK_EQ(x.u32(), 2u); CHECK(x.done()); }
  r = call(Op::Barrier, [](Writer& w) { w.bytes("b"); w.u32(0); w.u32(0); });
  CHECK_EQ(r.status, static_cast<uint8_t>(Status::Error));
  CHECK(ping_ok(*a, 4));
}

TEST(too_large_key_keeps_connection) {
  Server srv(quiet_config());
  srv.start();
  auto a = greeted(srv.port());
  a->send(set_frame(3, std::string(kMaxKeyBytes + 1, 'k'), "v"));
  Reply r = a->recv();
  CHECK_EQ(r.status, static_cast<uint8_t>(Status::TooLarge));
  CHECK(ping_ok(*a, 1));
}

TEST(ephemeral_key_dies_with_its_connection) {
  Server srv(quiet_config());
  srv.start();
  auto owner = greeted(srv.port());
  auto watcher = greeted(srv.port());
  owner->send(set_frame(1, "live/a", "1", kFlagEphemeral));
  CHECK(owner->recv().ok);
  watcher->send(frame(Op::Watch, 9, [](Writer& w) {
    w.bytes("live/");
    w.u8(1);
    w.u64(kWatchFromNow);
    w.u32(kWaitMs);
  }));
  CHECK(!watcher->readable_within(30));
  owner->close();
  Reply r = watcher->recv();
  CHECK(r.ok);
  CHECK_EQ(r.id, 9u);
  Reader rr = r.reader();
  CHECK_EQ(rr.u8(), static_cast<uint8_t>(EventKind::Delete));
  CHECK_EQ(rr.bytes(100), std::string_view("live/a"));
}

TEST(barrier_across_connections) {
  Server srv(quiet_config());
  srv.start();
  auto a = greeted(srv.port());
  auto b = greeted(srv.port());
  auto barrier = [](uint32_t id) {
    return frame(Op::Barrier, id, [](Writer& w) {
      w.bytes("bar");
      w.u32(2);
      w.u32(kWaitMs);
    });
  };
  a->send(barrier(1));
  CHECK(!a->readable_within(30));
  b->send(barrier(2));
  Reply ra = a->recv(), rb = b->recv();
  CHECK_EQ(ra.status, uint8_t{0});
  CHECK_EQ(rb.status, uint8_t{0});
  CHECK_EQ(ra.reader().u64(), 0ull);
}

TEST(stats_opcode_and_accessor) {
  Server srv(quiet_config());
  srv.start();
  auto a = greeted(srv.port());
  a->send(set_frame(1, "k", "v"));
  CHECK(a->recv().ok);
  a->send(frame(Op::Stats, 2));
  Reply r = a->recv();
  Reader rr = r.reader();
  const uint32_t n = rr.u32();
  bool saw_keys = false;
  for (uint32_t i = 0; i < n; ++i) {
    auto name = rr.bytes(100);
    const uint64_t v = rr.u64();
    if (name == "keys") saw_keys = v == 1;
  }
  CHECK(rr.done());
  CHECK(saw_keys);
  CHECK_EQ(stat(srv, "connections"), 1ull);
  CHECK_EQ(stat(srv, "keys"), 1ull);
  CHECK_EQ(stat(srv, "revision"), 1ull);
  CHECK(stat(srv, "bytes_buffered") != ~0ull);
}

// Each bad input closes only its own connection; a healthy one keeps working.
void expect_bad_input_closes(const std::string& what, const std::function<void(Sock&)>& act,
                             bool counts_as_bad = true) {
  Server srv(quiet_config());
  srv.start();
  auto healthy = greeted(srv.port());
  Sock bad(srv.port());
  CHECK(bad.connected());
  act(bad);
  const bool closed = bad.closed_by_peer();
  if (!closed) std::fprintf(stderr, "not closed: %s\n", what.c_str());
  CHECK(closed);
  CHECK(ping_ok(*healthy, 42));
  if (counts_as_bad) CHECK_EQ(stat(srv, "connections_closed_bad_input"), 1ull);
  CHECK_EQ(stat(srv, "connections"), 1ull);
}

const std::string kPre(kNativePreamble, kPreambleBytes);

TEST(bad_input_garbage_first_byte) {
  expect_bad_input_closes("garbage", [](Sock& s) { s.send("GET / HTTP/1.1\r\n\r\n"); });
}
TEST(bad_input_wrong_preamble) {
  expect_bad_input_closes("preamble", [](Sock& s) { s.send("ESTX"); });
}
// ---- torch's TCPStore protocol on the same port ----
const std::string kTorchValidate("\x00\xce\xf7\x85\x3c", 5);
std::string le64(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }
std::string tstr(std::string_view s) { return le64(s.size()) + std::string(s); }
std::string top(uint8_t op) { return std::string(1, static_cast<char>(op)); }

TEST(torch_protocol_shares_the_key_space) {
  Server srv(quiet_config());
  srv.start();
  Sock t(srv.port());
  CHECK(t.send(kTorchValidate + top(13) + std::string("\x34\x12\x00\x00", 4)));
  CHECK_EQ(t.read_bytes(4), std::string("\x34\x12\x00\x00", 4));  // PING echo
  CHECK(t.send(top(1) + tstr("/k") + tstr("v")));                     // SET "/k": no reply
  auto native = greeted(srv.port());
  CHECK(native->send(frame(Op::TryGet, 7, [](Writer& w) { w.bytes("k"); })));
  const Reply r = native->recv();
  CHECK(r.ok && r.status == 0);
  Reader rr = r.reader();
  CHECK_EQ(rr.u8(), uint8_t{1});
  CHECK_EQ(std::string(rr.bytes(10)), std::string("v"));
  CHECK(t.send(top(3) + tstr("/k")));  // GET
  CHECK_EQ(t.read_bytes(9), le64(1) + "v");
  CHECK(t.send(top(17)));  // LIST_KEYS: the client's "/" comes back
  CHECK_EQ(t.read_bytes(8 + 8 + 2), le64(1) + tstr("/k"));
}

TEST(torch_wait_is_deferred_and_cancellable) {
  Server srv(quiet_config());
  srv.start();
  Sock t(srv.port());
  CHECK(t.send(kTorchValidate + top(6) + le64(1) + tstr("/w")));  // WAIT ["/w"]
  CHECK(!t.readable_within(100));
  CHECK(t.send(top(12)));  // CANCEL_WAIT
  CHECK_EQ(t.read_bytes(1), std::string(1, '\x01'));
  CHECK(t.send(top(6) + le64(1) + tstr("/q")));  // WAIT on a queue's name
  auto native = greeted(srv.port());
  CHECK(native->send(frame(Op::QueuePush, 2, [](Writer& w) { w.bytes("q"); w.bytes("item"); })));
  CHECK_EQ(t.read_bytes(1), std::string(1, '\x00'));  // a non-empty queue satisfies torch's WAIT
  CHECK(t.send(top(15) + tstr("/q")));                  // QUEUE_POP: length before, then the item
  CHECK_EQ(t.read_bytes(8 + 8 + 4), le64(1) + tstr("item"));
}

TEST(bad_input_torch_wrong_magic) {
  expect_bad_input_closes("torch magic", [](Sock& s) { s.send(std::string("\x00\xde\xad\xbe\xef", 5)); });
}
TEST(bad_input_torch_unknown_opcode) {
  expect_bad_input_closes("torch opcode", [](Sock& s) { s.send(kTorchValidate + top(99)); });
}
TEST(bad_input_torch_add_on_text) {
  expect_bad_input_closes("torch add", [](Sock& s) {
    s.send(kTorchValidate + top(1) + tstr("/t") + tstr("text") + top(4) + tstr("/t") + le64(1));
  });
}
TEST(bad_input_torch_huge_key) {
  expect_bad_input_closes("torch key", [](Sock& s) { s.send(kTorchValidate + top(3) + le64(1ull << 40)); });
}
TEST(bad_input_huge_declared_length) {
  expect_bad_input_closes("huge", [](Sock& s) {
    std::string f = kPre + hello_frame();
    Writer(f).u32(0xFFFFFFF0u);
    s.send(f);
  });
}
TEST(bad_input_unknown_opcode) {
  expect_bad_input_closes("opcode", [](Sock& s) {
    std::string f = kPre + hello_frame();
    Writer w(f);
    w.begin_frame(99, 1);
    w.end_frame();
    s.send(f);
  });
}
TEST(bad_input_non_hello_first_frame) {
  expect_bad_input_closes("no hello", [](Sock& s) { s.send(kPre + ping_frame(1, 1)); });
}
TEST(bad_input_malformed_payload) {
  expect_bad_input_closes("malformed", [](Sock& s) {
    s.send(kPre + hello_frame() + frame(Op::Ping, 2, [](Writer& w) { w.u32(1); }));
  });
}
TEST(bad_input_truncated_frame_then_close) {
  // The client gives up half-way: the server drops it and the other connection never notices.
  expect_bad_input_closes(
      "truncated",
      [](Sock& s) {
        const std::string f = kPre + hello_frame() + set_frame(2, "k", "value");
        s.send(f.substr(0, f.size() - 3));
        s.shutdown_write();
      },
      false);
}

TEST(unfinished_frame_times_out) {
  ServerConfig cfg = quiet_config();
  cfg.frame_timeout_ms = 100;
  Server srv(cfg);
  srv.start();
  auto healthy = greeted(srv.port());
  auto slow = greeted(srv.port());
  const std::string f = set_frame(2, "k", "value");
  slow->send(f.substr(0, 6));
  const auto t0 = Clock::now();
  CHECK(slow->closed_by_peer());
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  CHECK(ms >= 80);
  CHECK(ping_ok(*healthy, 8));
  CHECK_EQ(stat(srv, "connections_closed_bad_input"), 1ull);
  // An idle connection between requests is not timed out.
  CHECK(!healthy->readable_within(200));
  CHECK(ping_ok(*healthy, 9));
}

TEST(buffer_budget_drops_the_connection_that_would_exceed_it) {
  ServerConfig cfg = quiet_config();
  cfg.max_buffered_bytes = 3 * 1024 * 1024;
  Server srv(cfg);
  srv.start();
  auto writer = greeted(srv.port());
  auto sleeper = greeted(srv.port());
  std::string gets;
  constexpr uint32_t kGets = 24;
  for (uint32_t i = 0; i < kGets; ++i) gets += get_frame(10 + i, "w", kNoTimeout);
  CHECK(sleeper->send(gets));
  const auto deadline = Clock::now() + std::chrono::milliseconds(kWaitMs);
  while (stat(srv, "waiters") < kGets && Clock::now() < deadline) ::usleep(1000);
  CHECK_EQ(stat(srv, "waiters"), uint64_t{kGets});
  // One set wakes 24 MiB of replies for a connection that does not read: more than the kernel's
  // socket buffers take and over the 3 MiB budget. That connection is dropped before the reply
  // that would exceed the budget is built; the writer is served.
  CHECK(writer->send(set_frame(2, "w", std::string(1024 * 1024, 'x'))));
  Reply r = writer->recv();
  CHECK(r.ok && r.status == 0 && r.id == 2);
  CHECK(sleeper->closed_by_peer());
  CHECK(ping_ok(*writer, 3));
  CHECK(stat(srv, "bytes_buffered") < cfg.max_buffered_bytes);
}

TEST(a_client_that_does_not_read_is_paused_then_resumed) {
  Server srv(quiet_config());
  srv.start();
  auto writer = greeted(srv.port());
  const std::string value(2 * 1024 * 1024, 'v');
  CHECK(writer->send(set_frame(2, "big", value)));
  CHECK(writer->recv().ok);
  auto reader = greeted(srv.port());
  std::string reqs;
  constexpr uint32_t kRequests = 40;  // 80 MiB of replies, more than kMaxWriteBufferBytes
  for (uint32_t i = 0; i < kRequests; ++i)
    reqs += frame(Op::TryGet, 100 + i, [](Writer& w) { w.bytes("big"); });
  CHECK(reader->send(reqs));
  CHECK(ping_ok(*writer, 4));
  ::usleep(100 * 1000);
  // Paused: the server holds at most about kOutputPauseBytes plus one reply for it.
  CHECK(stat(srv, "bytes_buffered") <= kOutputPauseBytes + value.size() + 64 * 1024);
  for (uint32_t i = 0; i < kRequests; ++i) {  // every reply, in order, once it reads
    Reply r = reader->recv();
    CHECK(r.ok && r.status == 0 && r.id == 100 + i);
    CHECK_EQ(r.payload.size(), 1 + 4 + value.size() + 8);
  }
  CHECK(ping_ok(*reader, 5));
}

TEST(max_connections_refuses_extra) {
  ServerConfig cfg = quiet_config();
  cfg.max_connections = 2;
  Server srv(cfg);
  srv.start();
  auto a = greeted(srv.port());
  auto b = greeted(srv.port());
  Sock c(srv.port());
  CHECK(c.closed_by_peer());
  CHECK(ping_ok(*a, 1));
  CHECK_EQ(stat(srv, "connections_refused"), 1ull);
}

TEST(connect_storm) {
  Server srv(quiet_config());
  srv.start();
  constexpr int kClients = 1000;
  std::vector<std::unique_ptr<Sock>> socks;
  for (int i = 0; i < kClients; ++i) {
    socks.push_back(std::make_unique<Sock>(srv.port()));
    CHECK(socks.back()->connected());
  }
  // Every one is served: a PING through the last and the first.
  auto& last = *socks.back();
  last.send(kPre + hello_frame());
  CHECK(last.recv().ok);
  CHECK(ping_ok(last, 3));
  const auto deadline = Clock::now() + std::chrono::milliseconds(kWaitMs);
  while (stat(srv, "connections") != kClients && Clock::now() < deadline) {
    pollfd none{};
    ::poll(&none, 0, 5);
  }
  CHECK_EQ(stat(srv, "connections"), uint64_t{kClients});
}

TEST(stop_closes_every_fd_promptly) {
  const int before = count_fds();
  {
    Server srv(quiet_config());
    srv.start();
    auto a = greeted(srv.port());
    auto b = greeted(srv.port());
    a->send(get_frame(1, "parked", kNoTimeout));
    CHECK(!a->readable_within(20));
    const auto t0 = Clock::now();
    srv.stop();
    srv.stop();  // idempotent
    CHECK(!srv.running());
    CHECK(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count() < 1000);
    CHECK(a->closed_by_peer());
  }
  CHECK_EQ(count_fds(), before);
}

TEST(bind_failures_throw_on_caller_thread) {
  ServerConfig cfg = quiet_config();
  cfg.host = "not-a-number.example";
  bool threw = false;
  try {
    Server srv(cfg);
  } catch (const std::exception&) {
    threw = true;
  }
  CHECK(threw);
  ServerConfig v6 = quiet_config();
  v6.host = "::";
  try {
    Server srv(v6);  // dual-stack: an IPv4 client can connect
    srv.start();
    auto a = greeted(srv.port());
    CHECK(ping_ok(*a, 5));
  } catch (const std::exception&) {
    // no IPv6 in this sandbox: nothing to check
  }
}
