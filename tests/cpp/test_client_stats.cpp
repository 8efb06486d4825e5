// call_stats (client/stats.hpp): bucket edges, names, concurrent recording, and the outcomes a
// Client records against an in-process Server on loopback.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "client/client.hpp"
#include "client/stats.hpp"
#include "server/server.hpp"

using namespace elasticstore;
namespace cs = elasticstore::call_stats;
using std::chrono::milliseconds;
using std::chrono::nanoseconds;

namespace {

cs::OpSnapshot find(const std::string& op) {
  for (const cs::OpSnapshot& s : cs::snapshot()) {
    if (s.op == op) return s;
  }
  return cs::OpSnapshot{};
}

uint64_t total(const cs::OpSnapshot& s) {
  uint64_t n = 0;
  for (const uint64_t c : s.calls) n += c;
  return n;
}

uint64_t bucket_sum(const cs::OpSnapshot& s) {
  uint64_t n = 0;
  for (const uint64_t c : s.buckets) n += c;
  return n;
}

// A spread of durations over the first buckets (0 to 990 us).
nanoseconds microseconds_of(int thread, int i) {
  return nanoseconds(static_cast<int64_t>((thread * 31 + i) % 100) * 10'000);
}

}  // namespace

TEST(bucket_edges_and_names) {
  // ALLOW_PEERS: no other test here calls it.
  const cs::OpSnapshot before = find("allow_peers");
  CHECK_EQ(total(before), uint64_t{0});
  cs::record(Op::AllowPeers, cs::Outcome::Ok, nanoseconds(cs::kLatencyBoundsNs[0]));  // <= 50 us
  cs::record(Op::AllowPeers, cs::Outcome::Ok, nanoseconds(cs::kLatencyBoundsNs[0] + 1));
  cs::record(Op::AllowPeers, cs::Outcome::Error, nanoseconds(cs::kLatencyBoundsNs.back() + 1));
  cs::record(Op::AllowPeers, cs::Outcome::Network, nanoseconds(-5));  // clamped to 0
  const cs::OpSnapshot s = find("allow_peers");
  CHECK_EQ(s.buckets[0], uint64_t{2});
  CHECK_EQ(s.buckets[1], uint64_t{1});
  CHECK_EQ(s.buckets[cs::kBuckets - 1], uint64_t{1});
  CHECK_EQ(s.calls[static_cast<int>(cs::Outcome::Ok)], uint64_t{2});
  CHECK_EQ(s.calls[static_cast<int>(cs::Outcome::Error)], uint64_t{1});
  CHECK_EQ(s.calls[static_cast<int>(cs::Outcome::Network)], uint64_t{1});
  CHECK_EQ(s.total_ns, static_cast<uint64_t>(2 * cs::kLatencyBoundsNs[0] + 1 +
                                             cs::kLatencyBoundsNs.back() + 1));
  CHECK_EQ(std::string(cs::outcome_name(cs::Outcome::Timeout)), std::string("timeout"));
  for (std::size_t i = 1; i < cs::kLatencyBoundsNs.size(); ++i) {
    CHECK(cs::kLatencyBoundsNs[i - 1] < cs::kLatencyBoundsNs[i]);
  }
}

TEST(concurrent_records_are_all_counted) {
  constexpr int kThreads = 4, kEach = 20000;
  const uint64_t before = total(find("queue_len"));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < kEach; ++i) {
        cs::record(Op::QueueLen, cs::Outcome::Ok, microseconds_of(t, i));
      }
    });
  }
  for (auto& th : threads) th.join();
  const cs::OpSnapshot s = find("queue_len");
  CHECK_EQ(total(s) - before, static_cast<uint64_t>(kThreads * kEach));
  CHECK_EQ(bucket_sum(s), total(s));
}

TEST(client_records_outcomes) {
  ServerConfig config;
  config.host = "127.0.0.1";
  config.port = 0;
  config.log_level = LogLevel::Off;
  auto server = std::make_unique<Server>(config);
  server->start();
  ClientOptions o;
  o.connect_timeout = milliseconds(2000);
  o.reconnect_timeout = milliseconds(500);
  o.op_timeout = milliseconds(2000);
  const uint64_t connects = total(find("connect"));
  const cs::OpSnapshot get0 = find("get"), set0 = find("set");
  Client c("127.0.0.1", server->port(), o);
  c.set("k", "v");
  CHECK_EQ(c.get("k", milliseconds(100)), std::string("v"));
  bool timed_out = false;
  try {
    c.get("missing", milliseconds(50));
  } catch (const TimeoutError&) {
    timed_out = true;
  }
  CHECK(timed_out);
  bool refused = false;
  try {
    c.set(std::string(kMaxKeyBytes + 1, 'x'), "v");  // refused before sending: not counted
  } catch (const StoreError&) {
    refused = true;
  }
  CHECK(refused);
  const cs::OpSnapshot get1 = find("get"), set1 = find("set");
  CHECK_EQ(total(find("connect")) - connects, uint64_t{1});
  CHECK_EQ(set1.calls[0] - set0.calls[0], uint64_t{1});
  CHECK_EQ(total(set1) - total(set0), uint64_t{1});
  CHECK_EQ(get1.calls[static_cast<int>(cs::Outcome::Ok)] -
               get0.calls[static_cast<int>(cs::Outcome::Ok)], uint64_t{1});
  CHECK_EQ(get1.calls[static_cast<int>(cs::Outcome::Timeout)] -
               get0.calls[static_cast<int>(cs::Outcome::Timeout)], uint64_t{1});
  CHECK(get1.total_ns - get0.total_ns >= 50'000'000u);
  server.reset();
  const cs::OpSnapshot set2 = find("set");
  int network = 0;
  for (int i = 0; i < 2; ++i) {
    try {
      c.set("k", "v");
    } catch (const NetworkError&) {
      ++network;
    }
  }
  CHECK_EQ(network, 2);
  const cs::OpSnapshot set3 = find("set");
  CHECK_EQ(set3.calls[static_cast<int>(cs::Outcome::Network)] -
               set2.calls[static_cast<int>(cs::Outcome::Network)], uint64_t{2});
  CHECK_EQ(bucket_sum(set3), total(set3));
}
