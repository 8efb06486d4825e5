// elasticstore::Client against an in-process elasticstore::Server on loopback, and against a
// scripted fake server for the failure paths a real server does not produce.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "client/client.hpp"
#include "server/server.hpp"

using namespace elasticstore;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

std::unique_ptr<Server> make_server(uint16_t port = 0) {
  ServerConfig config;
  config.host = "127.0.0.1";
  config.port = port;
  config.log_level = LogLevel::Off;
  auto s = std::make_unique<Server>(config);
  s->start();
  return s;
}

ClientOptions quick_options() {
  ClientOptions o;
  o.connect_timeout = milliseconds(5000);
  o.client_name = "test_client";
  return o;
}

double elapsed_s(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Runs f, expecting it to throw E; returns its message (or a note that it did not).
template <typename E, typename F>
std::string expect_throw(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<wrong exception type: ") + e.what() + ">";
  }
  return "<nothing thrown>";
}

uint16_t free_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(s);
  return ntohs(a.sin_port);
}

uint64_t stat(Client& c, const std::string& name) {
  for (const auto& [k, v] : c.stats()) {
    if (k == name) return v;
  }
  return ~0ull;
}

// A scripted server for one connection: answers HELLO, then calls `behave` with the socket and
// each request frame (opcode, request id).
class FakeServer {
 public:
  using Behave = std::function<bool(int fd, uint8_t op, uint32_t id)>;  // false: stop serving
  explicit FakeServer(Behave behave) : behave_(std::move(behave)) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(listen_fd_, 4);
    socklen_t len = sizeof a;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] {
      serve();
      if (conn_fd_ >= 0) ::shutdown(conn_fd_, SHUT_RDWR);  // the client sees EOF
    });
  }
  ~FakeServer() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    if (conn_fd_ >= 0) ::shutdown(conn_fd_, SHUT_RDWR);
    thread_.join();
    ::close(listen_fd_);
    if (conn_fd_ >= 0) ::close(conn_fd_);
  }
  uint16_t port() const { return port_; }

  static void reply(int fd, uint8_t status, uint32_t id, const std::string& payload) {
    std::string out;
    Writer w(out);
    w.begin_frame(status, id);
    out += payload;
    w.end_frame();
    (void)!::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
  }

 private:
  void serve() {
    conn_fd_ = ::accept(listen_fd_, nullptr, nullptr);
    if (conn_fd_ < 0) return;
    std::string buf;
    char pre[4];
    if (::recv(conn_fd_, pre, 4, MSG_WAITALL) != 4) return;
    bool hello = true;
    for (;;) {
      FrameHeader h;
      while (peek_frame(buf.data(), buf.size(), kMaxFrameBytes, &h) != FrameParse::Ready) {
        char chunk[4096];
        const ssize_t n = ::recv(conn_fd_, chunk, sizeof chunk, 0);
        if (n <= 0) return;
        buf.append(chunk, static_cast<std::size_t>(n));
      }
      buf.erase(0, h.total());
      if (hello) {
        std::string p;
        Writer w(p);
        w.u32(kProtocolVersion);
        w.u64(42);
        w.bytes("");  // no server nonce: no authentication
        reply(conn_fd_, 0, h.request_id, p);
        hello = false;
        continue;
      }
      if (!behave_(conn_fd_, h.code, h.request_id)) return;
    }
  }

  Behave behave_;
  int listen_fd_ = -1;
  std::atomic<int> conn_fd_{-1};
  uint16_t port_ = 0;
  std::thread thread_;
};

}  // namespace

TEST(basic_operations) {
  auto server = make_server();
  Client c("127.0.0.1", server->port(), quick_options());
  CHECK(c.connected());
  CHECK(c.session_id() != 0);
  c.ping();

  const uint64_t r1 = c.set("k", "v");
  CHECK(r1 > 0);
  CHECK_EQ(c.get("k", milliseconds(1000)), std::string("v"));
  auto tg = c.try_get("k");
  CHECK(tg.has_value());
  CHECK_EQ(tg->first, std::string("v"));
  CHECK_EQ(tg->second, r1);
  CHECK(!c.try_get("missing").has_value());

  CHECK_EQ(c.add("n", 5), int64_t{5});
  CHECK_EQ(c.add("n", -8), int64_t{-3});
  CHECK_EQ(c.get("n", milliseconds(0)), std::string("-3"));

  auto cs = c.compare_set("cas", "", "one");
  CHECK(cs.swapped);
  CHECK(cs.exists);
  CHECK_EQ(cs.current, std::string("one"));
  cs = c.compare_set("cas", "wrong", "two");
  CHECK(!cs.swapped);
  CHECK_EQ(cs.current, std::string("one"));
  cs = c.compare_set("cas", "one", "two");
  CHECK(cs.swapped);
  CHECK_EQ(cs.current, std::string("two"));
  cs = c.compare_set("nope", "x", "y");
  CHECK(!cs.swapped);
  CHECK(!cs.exists);

  c.wait({"k", "n"}, milliseconds(1000));
  c.wait({}, milliseconds(0));
  CHECK(c.check({"k", "cas"}));
  CHECK(!c.check({"k", "missing"}));

  const int64_t before = c.num_keys();
  CHECK(c.delete_key("cas"));
  CHECK(!c.delete_key("cas"));
  CHECK_EQ(c.num_keys(), before - 1);

  c.set("p/b", "2");
  c.set("p/a", "1");
  c.set("q", "3");
  CHECK(c.list_keys("p/") == (std::vector<std::string>{"p/a", "p/b"}));
  CHECK(c.list_keys().size() >= 4u);

  const uint64_t ra = c.append("ap", "ab");
  CHECK(c.append("ap", "cd") > ra);
  CHECK_EQ(c.get("ap", milliseconds(0)), std::string("abcd"));

  const uint64_t rm = c.multi_set({"m1", "m2", "m3"}, {"x", "", "z"});
  CHECK(rm > ra);
  CHECK(c.multi_get({"m1", "m2", "m3"}, milliseconds(1000)) ==
        (std::vector<std::string>{"x", "", "z"}));
  CHECK(c.multi_get({}, milliseconds(0)).empty());

  CHECK_EQ(c.queue_push("qq", "a"), int64_t{1});
  CHECK_EQ(c.queue_push("qq", "b"), int64_t{2});
  CHECK_EQ(c.queue_len("qq"), int64_t{2});
  CHECK_EQ(c.queue_pop("qq", milliseconds(0)).value_or("?"), std::string("a"));
  CHECK_EQ(c.queue_pop("qq", milliseconds(1000)).value_or("?"), std::string("b"));
  CHECK(!c.queue_pop("qq", milliseconds(0)).has_value());
  CHECK_EQ(c.queue_len("qq"), int64_t{0});

  CHECK_EQ(c.barrier("b1", 1, milliseconds(1000)), uint64_t{0});
  CHECK_EQ(c.barrier("b1", 1, milliseconds(1000)), uint64_t{1});

  const uint64_t rw = c.set("wk", "1");
  c.set("wk", "2");
  WatchEvent ev = c.watch("wk", rw, milliseconds(1000));
  CHECK(ev.kind == EventKind::Set);
  CHECK_EQ(ev.key, std::string("wk"));
  CHECK_EQ(ev.value, std::string("2"));
  CHECK(ev.revision > rw);

  CHECK(stat(c, "connections") >= 1u);
  CHECK(stat(c, "keys") == static_cast<uint64_t>(c.num_keys()));
  CHECK(stat(c, "revision") >= ev.revision);
}

TEST(binary_and_large_values) {
  auto server = make_server();
  Client c("127.0.0.1", server->port(), quick_options());
  std::string key("bin\0key\xff", 8);
  std::string value(256, '\0');
  for (int i = 0; i < 256; ++i) value[static_cast<std::size_t>(i)] = static_cast<char>(i);
  c.set(key, value);
  CHECK_EQ(c.get(key, milliseconds(1000)), value);
  std::string big(kMaxValueBytes, 'x');
  big[12345] = 'y';
  c.set("big", big);
  CHECK(c.get("big", milliseconds(5000)) == big);
  c.ping();
}

TEST(server_errors_and_validation) {
  auto server = make_server();
  Client c("127.0.0.1", server->port(), quick_options());
  c.set("s", "not a number");
  std::string msg = expect_throw<StoreError>([&] { c.add("s", 1); });
  CHECK(contains(msg, "add \"s\""));
  c.ping();  // the connection survives an error reply

  msg = expect_throw<StoreError>([&] { c.set(std::string(kMaxKeyBytes + 1, 'k'), "v"); });
  CHECK(contains(msg, "key of"));
  msg = expect_throw<StoreError>([&] { c.set("k", std::string(kMaxValueBytes + 1, 'v')); });
  CHECK(contains(msg, "value of"));
  msg = expect_throw<StoreError>([&] { c.multi_set({"a", "b"}, {"1"}); });
  CHECK(contains(msg, "2 keys but 1 values"));
  msg = expect_throw<StoreError>([&] { c.barrier("b", 0, milliseconds(10)); });
  CHECK(contains(msg, "world_size"));
  // Two keys with maximal values do not fit one frame: refused before sending.
  msg = expect_throw<StoreError>([&] {
    c.multi_set({"a", "b"}, {std::string(kMaxValueBytes, 'a'), std::string(kMaxValueBytes, 'b')});
  });
  CHECK(contains(msg, "frame limit"));
  c.ping();

  // A barrier whose world size differs from the generation in progress is an ERROR reply.
  auto other = c.clone();
  std::thread t([&] {
    expect_throw<TimeoutError>([&] { other->barrier("bw", 2, milliseconds(1500)); });
  });
  std::this_thread::sleep_for(milliseconds(200));
  msg = expect_throw<StoreError>([&] { c.barrier("bw", 3, milliseconds(100)); });
  CHECK(contains(msg, "barrier \"bw\""));
  t.join();
}

TEST(timeouts_within_deadline) {
  auto server = make_server();
  Client c("127.0.0.1", server->port(), quick_options());
  auto t0 = Clock::now();
  std::string msg = expect_throw<TimeoutError>([&] { c.get("absent", milliseconds(300)); });
  double dt = elapsed_s(t0);
  CHECK(dt >= 0.29 && dt < 0.8);
  CHECK(contains(msg, "get reached its timeout after"));
  CHECK(contains(msg, "\"absent\""));
  c.ping();  // usable after a timeout

  c.set("a", "1");
  t0 = Clock::now();
  msg = expect_throw<TimeoutError>([&] { c.wait({"a", "b"}, milliseconds(200)); });
  dt = elapsed_s(t0);
  CHECK(dt >= 0.19 && dt < 0.7);
  CHECK(contains(msg, "wait reached its timeout after"));
  CHECK(contains(msg, "[\"a\", \"b\"] (missing: [\"b\"])"));

  msg = expect_throw<TimeoutError>([&] { c.multi_get({"a", "zz"}, milliseconds(100)); });
  CHECK(contains(msg, "missing: [\"zz\"]"));
  msg = expect_throw<TimeoutError>([&] { c.queue_pop("emptyq", milliseconds(100)); });
  CHECK(contains(msg, "queue \"emptyq\""));
  msg = expect_throw<TimeoutError>([&] { c.barrier("bt", 3, milliseconds(100)); });
  CHECK(contains(msg, "arrived 1/3"));
  msg = expect_throw<TimeoutError>([&] { c.watch("never", std::nullopt, milliseconds(100)); });
  CHECK(contains(msg, "watch reached its timeout"));
  // Timeout 0 does not block.
  t0 = Clock::now();
  expect_throw<TimeoutError>([&] { c.get("absent", milliseconds(0)); });
  CHECK(elapsed_s(t0) < 0.2);
  c.ping();
  CHECK(c.connected());
}

TEST(blocking_get_woken_by_set) {
  auto server = make_server();
  Client c("127.0.0.1", server->port(), quick_options());
  auto setter = c.clone();
  std::thread t([&] {
    std::this_thread::sleep_for(milliseconds(150));
    setter->set("late", "here");
  });
  auto t0 = Clock::now();
  CHECK_EQ(c.get("late", kForever), std::string("here"));
  CHECK(elapsed_s(t0) >= 0.1);
  t.join();
}

TEST(connect_failure_names_endpoint) {
  const uint16_t port = free_port();
  ClientOptions o;
  o.connect_timeout = milliseconds(300);
  auto t0 = Clock::now();
  std::string msg = expect_throw<NetworkError>([&] { Client c("127.0.0.1", port, o); });
  const double dt = elapsed_s(t0);
  CHECK(dt >= 0.29 && dt < 1.5);
  CHECK(contains(msg, "127.0.0.1:" + std::to_string(port)));
  CHECK(contains(msg, "Connection refused"));
  // A name nobody answers for fails within the connect timeout (the lookup runs on a thread;
  // this machine's resolver never answers for it), naming the host.
  t0 = Clock::now();
  msg = expect_throw<NetworkError>([&] { Client c("no-such-host.invalid", port, o); });
  CHECK(elapsed_s(t0) < 1.0);
  CHECK(contains(msg, "cannot resolve \"no-such-host.invalid\""));
}

// Names resolve forward (getaddrinfo; never a reverse lookup): localhost, and this machine's own
// name when it maps to a loopback address (as MASTER_ADDR=$(hostname) does in torch jobs).
TEST(host_names_are_resolved) {
  auto server = make_server();
  Client c("localhost", server->port(), quick_options());
  c.set("by-name", "1");
  CHECK(c.check({"by-name"}));
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(name, nullptr, &hints, &res) == 0) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(res->ai_addr);
    const bool loopback = ntohl(in->sin_addr.s_addr) == INADDR_LOOPBACK;
    ::freeaddrinfo(res);
    if (loopback) {  // the server listens on 127.0.0.1 only
      Client h(name, server->port(), quick_options());
      CHECK(h.check({"by-name"}));
    }
  }
}

TEST(connect_retries_until_server_appears) {
  const uint16_t port = free_port();
  std::unique_ptr<Client> c;
  std::string error;
  std::thread t([&] {
    try {
      c = std::make_unique<Client>("127.0.0.1", port, quick_options());
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(milliseconds(400));
  auto server = make_server(port);
  t.join();
  CHECK_EQ(error, std::string());
  CHECK(c != nullptr);
  if (c) {
    c->set("x", "y");
    CHECK_EQ(c->get("x", milliseconds(100)), std::string("y"));
  }
}

TEST(ipv6_and_hostname) {
  auto server = make_server();
  Client c("localhost", server->port(), quick_options());  // forward lookup
  c.ping();
  ServerConfig config;
  config.host = "::1";
  config.port = 0;
  config.log_level = LogLevel::Off;
  std::unique_ptr<Server> s6;
  try {
    s6 = std::make_unique<Server>(config);
  } catch (const std::exception&) {
    return;  // no IPv6 loopback here
  }
  s6->start();
  Client c6("[::1]", s6->port(), quick_options());
  c6.set("six", "6");
  CHECK_EQ(c6.get("six", milliseconds(100)), std::string("6"));
}

TEST(reconnect_refuses_a_restarted_server) {
  auto server = make_server();
  const uint16_t port = server->port();
  Client c("127.0.0.1", port, quick_options());
  c.set("before", "1");
  auto clone = c.clone();
  CHECK((c.session_id() >> kSessionCounterBits) != 0);  // the instance's tag
  CHECK_EQ(clone->session_id() >> kSessionCounterBits, c.session_id() >> kSessionCounterBits);
  server->stop();
  server.reset();
  server = make_server(port);
  // The next call on a connection idle for longer than kIdleCheck (100 ms) notices that it was
  // closed and reconnects before sending; the new instance's keys are not the ones this client
  // knew ("before" is gone): refused, at once and on every later call, never retried.
  std::this_thread::sleep_for(milliseconds(150));
  for (int i = 0; i < 2; ++i) {
    auto t0 = Clock::now();
    std::string msg = expect_throw<NetworkError>([&] { c.set("after", "2"); });
    CHECK(elapsed_s(t0) < 1.0);
    CHECK(contains(msg, "another server instance"));
    CHECK(!c.connected());
  }
  expect_throw<NetworkError>([&] { c.clone(); });  // a clone is bound to the same instance
  std::this_thread::sleep_for(milliseconds(150));
  expect_throw<NetworkError>([&] { clone->ping(); });
  Client fresh("127.0.0.1", port, quick_options());  // a new client may use it
  CHECK(!fresh.try_get("before").has_value());
  fresh.set("after", "2");
  CHECK_EQ(fresh.get("after", milliseconds(100)), std::string("2"));
}

TEST(reconnect_gives_up_after_reconnect_timeout) {
  auto server = make_server();
  ClientOptions o = quick_options();
  o.reconnect_timeout = milliseconds(300);
  Client c("127.0.0.1", server->port(), o);
  c.ping();
  server->stop();
  std::this_thread::sleep_for(milliseconds(150));  // idle for longer than kIdleCheck
  auto t0 = Clock::now();
  std::string msg = expect_throw<NetworkError>([&] { c.ping(); });
  const double dt = elapsed_s(t0);
  CHECK(dt >= 0.29 && dt < 1.5);
  CHECK(contains(msg, "could not reconnect to 127.0.0.1:"));
  CHECK(contains(msg, "Connection refused"));
}

TEST(request_in_flight_when_server_dies) {
  auto server = make_server();
  Client c("127.0.0.1", server->port(), quick_options());
  std::string msg;
  std::thread t([&] { msg = expect_throw<NetworkError>([&] { c.get("x", kForever); }); });
  std::this_thread::sleep_for(milliseconds(200));
  server->stop();
  t.join();
  CHECK(contains(msg, "127.0.0.1:"));
  CHECK(!c.connected());
}

TEST(clone_is_a_new_session) {
  auto server = make_server();
  Client c("127.0.0.1", server->port(), quick_options());
  auto d = c.clone();
  CHECK(d->session_id() != c.session_id());
  CHECK_EQ(d->host(), c.host());
  CHECK_EQ(d->port(), c.port());
  c.set("shared", "1");
  CHECK_EQ(d->get("shared", milliseconds(100)), std::string("1"));
}

TEST(threads_share_one_client) {
  auto server = make_server();
  Client c("127.0.0.1", server->port(), quick_options());
  constexpr int kThreads = 8, kOps = 200;
  std::vector<std::thread> ts;
  std::atomic<int> errors{0};
  for (int i = 0; i < kThreads; ++i) {
    ts.emplace_back([&, i] {
      try {
        for (int j = 0; j < kOps; ++j) {
          c.add("counter", 1);
          c.set("t" + std::to_string(i), std::to_string(j));
          if (c.get("t" + std::to_string(i), milliseconds(1000)) != std::to_string(j)) ++errors;
        }
      } catch (const std::exception&) {
        ++errors;
      }
    });
  }
  for (auto& t : ts) t.join();
  CHECK_EQ(errors.load(), 0);
  CHECK_EQ(c.add("counter", 0), int64_t{kThreads * kOps});
}

TEST(watch_sees_every_change_in_order) {
  auto server = make_server();
  Client c("127.0.0.1", server->port(), quick_options());
  const uint64_t start = c.set("other", "x");
  std::vector<uint64_t> revs;
  for (int i = 0; i < 20; ++i) {
    revs.push_back(c.set("w/" + std::to_string(i % 3), std::to_string(i)));
  }
  c.delete_key("w/1");
  c.set("unrelated", "y");
  uint64_t after = start;
  for (int i = 0; i < 20; ++i) {
    WatchEvent ev = c.watch("w/", after, milliseconds(1000), /*prefix=*/true);
    CHECK(ev.kind == EventKind::Set);
    CHECK_EQ(ev.revision, revs[static_cast<std::size_t>(i)]);
    CHECK_EQ(ev.key, "w/" + std::to_string(i % 3));
    CHECK_EQ(ev.value, std::to_string(i));
    after = ev.revision;
  }
  WatchEvent del = c.watch("w/", after, milliseconds(1000), true);
  CHECK(del.kind == EventKind::Delete);
  CHECK_EQ(del.key, std::string("w/1"));
  // A change that happens while watching.
  auto writer = c.clone();
  std::thread t([&] {
    std::this_thread::sleep_for(milliseconds(100));
    writer->set("w/live", "now");
  });
  WatchEvent live = c.watch("w/", del.revision, milliseconds(2000), true);
  t.join();
  CHECK_EQ(live.key, std::string("w/live"));
  CHECK(live.revision > del.revision);
}

TEST(ephemeral_key_vanishes_with_its_session) {
  auto server = make_server();
  Client c("127.0.0.1", server->port(), quick_options());
  auto owner = c.clone();
  const uint64_t rev = owner->set("alive/node0", "1", /*ephemeral=*/true);
  CHECK(c.try_get("alive/node0").has_value());
  owner->close();
  WatchEvent ev = c.watch("alive/node0", rev, milliseconds(2000));
  CHECK(ev.kind == EventKind::Delete);
  CHECK(!c.try_get("alive/node0").has_value());
  std::string msg = expect_throw<NetworkError>([&] { owner->ping(); });
  CHECK(contains(msg, "closed"));
}

TEST(close_aborts_a_blocked_call) {
  auto server = make_server();
  Client c("127.0.0.1", server->port(), quick_options());
  std::string msg;
  std::thread t([&] { msg = expect_throw<NetworkError>([&] { c.get("never", kForever); }); });
  std::this_thread::sleep_for(milliseconds(150));
  auto t0 = Clock::now();
  c.close();
  t.join();
  CHECK(elapsed_s(t0) < 0.5);
  CHECK(contains(msg, "closed"));
  c.close();  // idempotent
}

TEST(interrupt_check_aborts_a_wait) {
  auto server = make_server();
  std::atomic<bool> interrupt{false};
  ClientOptions o = quick_options();
  o.interrupt_check = [&] { return interrupt.load(); };
  Client c("127.0.0.1", server->port(), o);
  std::thread t([&] {
    std::this_thread::sleep_for(milliseconds(150));
    interrupt = true;
  });
  auto t0 = Clock::now();
  std::string msg = expect_throw<InterruptedError>([&] { c.get("never", kForever); });
  t.join();
  CHECK(elapsed_s(t0) < 0.5);
  CHECK(contains(msg, "interrupted"));
  CHECK(!c.connected());
  interrupt = false;
  c.ping();  // reconnects
  CHECK(c.connected());
}

TEST(interrupt_check_while_waiting_for_the_mutex) {
  auto server = make_server();
  std::atomic<std::thread::id> victim{};
  ClientOptions o = quick_options();
  o.interrupt_check = [&] { return std::this_thread::get_id() == victim.load(); };
  Client c("127.0.0.1", server->port(), o);
  std::string got;
  std::thread holder([&] { got = c.get("slow", milliseconds(5000)); });
  std::this_thread::sleep_for(milliseconds(150));  // holder now owns the connection
  victim = std::this_thread::get_id();
  auto t0 = Clock::now();
  std::string msg = expect_throw<InterruptedError>([&] { c.ping(); });
  CHECK(elapsed_s(t0) < 0.5);
  CHECK(contains(msg, "another thread"));
  victim = std::thread::id();
  auto other = c.clone();
  other->set("slow", "done");
  holder.join();
  CHECK_EQ(got, std::string("done"));  // the holder's call was not disturbed
  CHECK(c.connected());
  c.ping();
}

TEST(client_deadline_when_server_is_silent) {
  FakeServer fake([](int, uint8_t, uint32_t) { return true; });  // reads, never answers
  ClientOptions o = quick_options();
  o.op_timeout = milliseconds(300);
  Client c("127.0.0.1", fake.port(), o);
  CHECK_EQ(c.session_id(), uint64_t{42});
  auto t0 = Clock::now();
  std::string msg = expect_throw<NetworkError>([&] { c.set("k", "v"); });
  double dt = elapsed_s(t0);
  CHECK(dt >= 0.29 && dt < 1.0);
  CHECK(contains(msg, "no reply to SET"));
  CHECK(contains(msg, "127.0.0.1:" + std::to_string(fake.port())));
  CHECK(!c.connected());
}

// The bound of every call follows set_op_timeout() (the Python Store's timeout), and the error
// names the operation and its key(s).
TEST(op_timeout_bounds_calls_and_names_their_keys) {
  FakeServer fake([](int, uint8_t, uint32_t) { return true; });  // reads, never answers
  Client c("127.0.0.1", fake.port(), quick_options());
  CHECK(c.op_timeout() == milliseconds(300'000));
  c.set_op_timeout(milliseconds(400));
  auto t0 = Clock::now();
  std::string msg = expect_throw<NetworkError>([&] { c.add("counter", 1); });
  const double dt = elapsed_s(t0);
  CHECK(dt >= 0.39 && dt < 1.2);
  CHECK(contains(msg, "add \"counter\": "));
  CHECK(contains(msg, "no reply to ADD"));
}

TEST(op_timeout_bounds_the_reconnect) {
  FakeServer fake([](int, uint8_t, uint32_t) { return true; });
  ClientOptions o = quick_options();
  o.op_timeout = milliseconds(300);
  Client c("127.0.0.1", fake.port(), o);
  expect_throw<NetworkError>([&] { c.set("k", "v"); });  // no reply: the connection is closed
  // The fake server accepts no second connection (it stays in the backlog, no HELLO reply):
  // reconnecting is bounded by the call's 300 ms, not by reconnect_timeout (30 s).
  auto t0 = Clock::now();
  std::string msg = expect_throw<NetworkError>([&] { c.check({"a", "b"}); });
  CHECK(elapsed_s(t0) < 1.5);
  CHECK(contains(msg, "check [\"a\", \"b\"]: "));
}

// fork(): the child drops the inherited socket (closes it without sending or shutdown) and makes
// its own connection; parent and child then never read each other's replies, and the parent's
// session (its ephemeral keys) survives the child.
TEST(fork_child_gets_its_own_connection) {
  auto server = make_server();
  Client c("127.0.0.1", server->port(), quick_options());
  c.set("eph", "parent", /*ephemeral=*/true);
  const uint64_t session = c.session_id();
  constexpr int kCalls = 300;
  const pid_t pid = ::fork();
  if (pid == 0) {
    int bad = 0;
    try {
      for (int i = 0; i < kCalls; ++i) {
        if (c.add("child/n", 1) != i + 1) ++bad;
        const std::string v = "c" + std::to_string(i);
        c.set("child/v", v);
        if (c.get("child/v", milliseconds(1000)) != v) ++bad;
      }
      if (c.session_id() == session) ++bad;
      c.close();  // must not wake or disturb the parent's calls
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
      ++bad;
    }
    ::_exit(bad == 0 ? 0 : 1);
  }
  CHECK(pid > 0);
  int bad = 0;
  try {
    for (int i = 0; i < kCalls; ++i) {
      if (c.add("parent/n", 1) != i + 1) ++bad;
      const std::string v = "p" + std::to_string(i);
      c.set("parent/v", v);
      if (c.get("parent/v", milliseconds(1000)) != v) ++bad;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parent: %s\n", e.what());
    ++bad;
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK_EQ(bad, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK_EQ(c.session_id(), session);  // the parent kept its connection
  CHECK_EQ(c.get("eph", milliseconds(0)), std::string("parent"));
  CHECK_EQ(c.get("child/n", milliseconds(0)), std::to_string(kCalls));
}

TEST(blocking_request_deadline_is_timeout_plus_slack) {
  FakeServer fake([](int, uint8_t, uint32_t) { return true; });
  Client c("127.0.0.1", fake.port(), quick_options());
  auto t0 = Clock::now();
  std::string msg = expect_throw<NetworkError>([&] { c.get("k", milliseconds(100)); });
  const double dt = elapsed_s(t0);
  CHECK(dt >= 2.09 && dt < 3.0);  // 100 ms + max(2 s, 10%)
  CHECK(contains(msg, "server timeout 0.100 s"));
}

TEST(mismatched_request_id_is_a_protocol_error) {
  FakeServer fake([](int fd, uint8_t, uint32_t id) {
    std::string p;
    Writer w(p);
    w.u64(1);
    FakeServer::reply(fd, 0, id + 7, p);
    return true;
  });
  Client c("127.0.0.1", fake.port(), quick_options());
  std::string msg = expect_throw<ProtocolError>([&] { c.set("k", "v"); });
  CHECK(contains(msg, "protocol error"));
  CHECK(!c.connected());
}

TEST(malformed_reply_is_a_protocol_error) {
  FakeServer fake([](int fd, uint8_t, uint32_t id) {
    FakeServer::reply(fd, 0, id, std::string(3, 'x'));  // SET wants a u64
    return true;
  });
  Client c("127.0.0.1", fake.port(), quick_options());
  std::string msg = expect_throw<ProtocolError>([&] { c.set("k", "v"); });
  CHECK(contains(msg, "malformed reply to SET"));
}

TEST(server_closing_mid_request_is_a_network_error) {
  FakeServer fake([](int, uint8_t, uint32_t) { return false; });  // closes on the first request
  Client c("127.0.0.1", fake.port(), quick_options());
  std::string msg = expect_throw<NetworkError>([&] { c.set("k", "v"); });
  CHECK(contains(msg, "closed the connection"));
}
