// KvState semantics, driven directly with a fake clock: no sockets.
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "server/kv_state.hpp"

using namespace elasticstore;

namespace {
uint64_t g_now = 1000;
uint64_t fake_clock() { return g_now; }

struct Fixture {
  KvState kv{&fake_clock};
  std::vector<Completion> done;
  Fixture() {
    kv.open_session(1);
    kv.open_session(2);
  }
  std::vector<Completion>& ready() {
    kv.take_ready(&done);
    return done;
  }
  // A GET completion names its key; the codec reads the value when it encodes the reply.
  std::string value_of(const Completion& c) const { return kv.find(c.key)->value; }
};
using SV = std::vector<std::string_view>;
}  // namespace

TEST(set_get_and_revisions) {
  Fixture f;
  CHECK_EQ(f.kv.set(1, "a", "1", false), 1ull);
  CHECK_EQ(f.kv.set(1, "b", "2", false), 2ull);
  CHECK_EQ(f.kv.set(1, "a", "3", false), 3ull);
  CHECK_EQ(f.kv.find("a")->value, std::string("3"));
  CHECK_EQ(f.kv.find("a")->mod_revision, 3ull);
  CHECK(f.kv.find("zz") == nullptr);
  CHECK_EQ(f.kv.num_keys(), std::size_t{2});
  CHECK(f.kv.erase("a"));
  CHECK(!f.kv.erase("a"));
  CHECK_EQ(f.kv.revision(), 4ull);
  f.kv.get(1, 9, "b", 0);
  auto& r = f.ready();
  CHECK_EQ(r.size(), std::size_t{1});
  CHECK(r[0].status == Status::Ok);
  CHECK_EQ(r[0].tag, 9ull);
  CHECK_EQ(r[0].key, std::string("b"));
  CHECK_EQ(f.value_of(r[0]), std::string("2"));
  CHECK(r[0].values.empty());  // no copy of the value
  f.kv.get(1, 10, "nope", 0);
  CHECK(f.ready().at(0).status == Status::Timeout);
}

TEST(add_semantics) {
  Fixture f;
  int64_t v = 0;
  CHECK(f.kv.add("n", 5, &v) == Status::Ok);
  CHECK_EQ(v, int64_t{5});
  CHECK(f.kv.add("n", -8, &v) == Status::Ok);
  CHECK_EQ(v, int64_t{-3});
  CHECK_EQ(f.kv.find("n")->value, std::string("-3"));
  f.kv.set(1, "s", "abc", false);
  CHECK(f.kv.add("s", 1, &v) == Status::WrongType);
  f.kv.set(1, "s", "", false);
  CHECK(f.kv.add("s", 1, &v) == Status::WrongType);
  f.kv.set(1, "s", "+1", false);
  CHECK(f.kv.add("s", 1, &v) == Status::WrongType);
  f.kv.set(1, "s", "99999999999999999999", false);
  CHECK(f.kv.add("s", 1, &v) == Status::WrongType);  // parse overflow
  f.kv.set(1, "m", "9223372036854775807", false);
  CHECK(f.kv.add("m", 1, &v) == Status::WrongType);  // sum overflow
  CHECK_EQ(f.kv.find("m")->value, std::string("9223372036854775807"));
}

TEST(compare_set_semantics) {
  Fixture f;
  CasResult r = f.kv.compare_set(1, "k", "", "one", false);
  CHECK(r.swapped && r.exists);
  CHECK_EQ(r.current, std::string("one"));
  r = f.kv.compare_set(1, "k", "zzz", "two", false);
  CHECK(!r.swapped && r.exists);
  CHECK_EQ(r.current, std::string("one"));
  r = f.kv.compare_set(1, "k", "one", "two", false);
  CHECK(r.swapped);
  CHECK_EQ(r.current, std::string("two"));
  r = f.kv.compare_set(1, "missing", "x", "y", false);
  CHECK(!r.swapped && !r.exists);
  CHECK(r.current.empty());
  CHECK(f.kv.find("missing") == nullptr);
}

TEST(append_and_limits) {
  Fixture f;
  uint64_t rev = 0;
  CHECK(f.kv.append("a", "x", &rev) == Status::Ok);
  CHECK(f.kv.append("a", "y", &rev) == Status::Ok);
  CHECK_EQ(f.kv.find("a")->value, std::string("xy"));
  CHECK_EQ(rev, 2ull);
  const std::string big(kMaxValueBytes, 'b');
  CHECK(f.kv.append("a", big, &rev) == Status::TooLarge);
}

TEST(waiters_woken_by_set_add_cas_append) {
  Fixture f;
  f.kv.get(2, 1, "a", kNoTimeout);
  f.kv.get(2, 2, "b", kNoTimeout);
  f.kv.get(2, 3, "c", kNoTimeout);
  f.kv.get(2, 4, "d", kNoTimeout);
  CHECK(f.ready().empty());
  CHECK_EQ(f.kv.waiter_count(), std::size_t{4});
  f.kv.set(1, "a", "A", false);
  int64_t v;
  f.kv.add("b", 2, &v);
  f.kv.compare_set(1, "c", "", "C", false);
  uint64_t rev;
  f.kv.append("d", "D", &rev);
  auto& r = f.ready();
  CHECK_EQ(r.size(), std::size_t{4});
  for (std::size_t i = 0; i < r.size(); ++i) CHECK_EQ(r[i].tag, uint64_t{i + 1});
  CHECK_EQ(f.value_of(r[1]), std::string("2"));
  CHECK_EQ(f.value_of(r[2]), std::string("C"));
  CHECK_EQ(f.kv.waiter_count(), std::size_t{0});
}

TEST(multi_key_wait_only_when_all_exist) {
  Fixture f;
  f.kv.wait(2, 7, SV{"x", "y", "z"}, kNoTimeout);
  f.kv.wait(2, 8, SV{"x", "y"}, kNoTimeout, WaitKind::MultiGet);
  f.kv.set(1, "y", "Y", false);
  CHECK(f.ready().empty());
  f.kv.set(1, "x", "X", false);
  auto& r = f.ready();
  CHECK_EQ(r.size(), std::size_t{1});
  CHECK_EQ(r.at(0).tag, 8ull);
  CHECK_EQ(r.at(0).values.size(), std::size_t{2});  // the keys: values are read when encoded
  CHECK_EQ(r.at(0).values.at(0), std::string("x"));
  f.kv.erase("x");  // deleted meanwhile: must not count as present
  f.kv.set(1, "z", "Z", false);
  CHECK(f.ready().empty());
  f.kv.set(1, "x", "X2", false);
  CHECK_EQ(f.ready().size(), std::size_t{1});
}

TEST(wait_timeout_reports_missing_keys) {
  Fixture f;
  f.kv.set(1, "have", "1", false);
  f.kv.wait(2, 3, SV{"have", "m1", "m2"}, 50);
  // Never early: the clock's "now" may be up to 1 ms past g_now, so 50 ms are over at g_now + 51.
  CHECK_EQ(f.kv.next_deadline(), g_now + 51);
  f.kv.expire(g_now + 50);
  CHECK(f.ready().empty());
  f.kv.expire(g_now + 51);
  auto& r = f.ready();
  CHECK_EQ(r.size(), std::size_t{1});
  CHECK(r[0].status == Status::Timeout);
  CHECK_EQ(r[0].values.size(), std::size_t{2});
  CHECK_EQ(r[0].values.at(1), std::string("m2"));
  CHECK_EQ(f.kv.waiter_count(), std::size_t{0});
  CHECK_EQ(f.kv.next_deadline(), kNoDeadline);
}

TEST(history_and_watch) {
  Fixture f;
  f.kv.set(1, "p/a", "1", false);  // rev 1
  f.kv.set(1, "q", "2", false);    // rev 2
  f.kv.set(1, "p/b", "3", false);  // rev 3
  f.kv.watch(1, 1, "p/", true, 1, 0);
  auto& r = f.ready();
  CHECK(r.at(0).status == Status::Ok);
  CHECK_EQ(r.at(0).key, std::string("p/b"));
  CHECK_EQ(r.at(0).revision, 3ull);
  f.kv.watch(1, 2, "q", false, 0, 0);
  CHECK_EQ(f.ready().at(0).revision, 2ull);
  f.kv.watch(1, 3, "q", false, 2, 0);
  CHECK(f.ready().at(0).status == Status::Timeout);
  // Live: a prefix watcher and an exact watcher; unrelated keys do not wake them.
  f.kv.watch(2, 4, "p/", true, kWatchFromNow, kNoTimeout);
  f.kv.watch(2, 5, "q", false, kWatchFromNow, kNoTimeout);
  f.kv.watch(2, 6, "p/zz", true, kWatchFromNow, kNoTimeout);
  f.kv.set(1, "p", "no", false);
  f.kv.set(1, "other", "no", false);
  CHECK(f.ready().empty());
  f.kv.erase("p/a");
  auto& r2 = f.ready();
  CHECK_EQ(r2.size(), std::size_t{1});
  CHECK_EQ(r2.at(0).tag, 4ull);
  CHECK(r2.at(0).event == EventKind::Delete);
  f.kv.set(1, "q", "v", false);
  CHECK_EQ(f.ready().at(0).tag, 5ull);
  f.kv.set(1, "p/zz/deep", "v", false);
  CHECK_EQ(f.ready().at(0).tag, 6ull);
}

TEST(history_compaction) {
  Fixture f;
  for (std::size_t i = 0; i < kWatchHistoryEvents + 10; ++i) f.kv.set(1, "k", "v", false);
  CHECK_EQ(f.kv.history_size(), kWatchHistoryEvents);
  f.kv.watch(1, 1, "k", false, 5, 0);
  auto& r = f.ready();
  CHECK(r.at(0).status == Status::Compacted);
  CHECK_EQ(r.at(0).revision, 11ull);  // oldest held
  f.kv.watch(1, 2, "k", false, 10, 0);
  CHECK(f.ready().at(0).status == Status::Ok);
}

// The history's index by key answers a watch from far back as the scan does: random sets of keys
// that nest as prefixes, past the history's bound (compaction), watched from random revisions.
TEST(watch_from_far_back_matches_a_scan_of_the_history) {
  Fixture f;
  const std::vector<std::string> keys = {"a", "a/b", "a/b/c", "ab", "b", "b/x", "c", "a/"};
  const std::string hot = "h/beat";  // most events, as heartbeats are: the others are rare,
  std::vector<std::string> log;      // so a watch of them often finds nothing in its scan
  std::mt19937_64 rng(20261128);     // log[r - 1]: the key of revision r
  uint64_t checked = 0, far = 0;
  const std::size_t total = kWatchHistoryEvents + 4 * kWatchScanEvents;
  for (std::size_t i = 0; i < total; ++i) {
    const std::string& k = rng() % 1000 < 997 ? hot : keys[rng() % keys.size()];
    f.kv.set(1, k, "v", false);
    log.push_back(k);
    if (i % 61 != 0) continue;
    const uint64_t rev = log.size();
    const uint64_t oldest = rev > kWatchHistoryEvents ? rev - kWatchHistoryEvents + 1 : 1;
    for (int q = 0; q < 3; ++q) {
      const std::string& w = keys[rng() % keys.size()];
      const bool prefix = rng() % 2 == 0;
      const uint64_t back = rng() % 2 == 0 ? rng() % (kWatchScanEvents * 2) : rng() % rev;
      const uint64_t after = rev - std::min(back, rev);
      uint64_t want = 0;
      if (after + 1 >= oldest && rev - after > kWatchScanEvents) ++far;
      for (uint64_t r = after + 1; r <= rev && want == 0; ++r) {
        const std::string& e = log[r - 1];
        if (prefix ? e.compare(0, w.size(), w) == 0 && e.size() >= w.size() : e == w) want = r;
      }
      f.done.clear();
      f.kv.watch(1, 100 + checked, w, prefix, after, 0);
      const Completion& c = f.ready().back();
      if (after + 1 < oldest) {
        CHECK(c.status == Status::Compacted);
      } else if (want == 0) {
        CHECK(c.status == Status::Timeout);
      } else {
        CHECK(c.status == Status::Ok);
        CHECK_EQ(c.revision, want);
        CHECK_EQ(c.key, log[want - 1]);
      }
      ++checked;
    }
  }
  CHECK(checked > 3000);
  CHECK(far > 1000);
  CHECK_EQ(f.kv.history_size(), kWatchHistoryEvents);
}

TEST(history_bounded_by_bytes) {
  Fixture f;
  const std::string big(kMaxValueBytes, 'v');
  for (int i = 0; i < 10; ++i) f.kv.set(1, "k", big, false);
  CHECK(f.kv.history_size() < 10u);
  CHECK(f.kv.history_size() >= 1u);
}

TEST(ephemeral_keys_removed_on_session_close) {
  Fixture f;
  f.kv.set(1, "eph", "1", true);
  f.kv.set(1, "unbound", "1", true);
  f.kv.set(2, "unbound", "2", false);  // a later plain set unbinds
  f.kv.compare_set(1, "cas", "", "x", true);
  f.kv.set(1, "plain", "1", false);
  f.kv.watch(2, 1, "", true, kWatchFromNow, kNoTimeout);
  f.kv.get(1, 2, "never", kNoTimeout);  // the closing session's own waiter is dropped silently
  const uint64_t before = f.kv.revision();
  f.kv.close_session(1);
  CHECK(f.kv.find("eph") == nullptr);
  CHECK(f.kv.find("cas") == nullptr);
  CHECK(f.kv.find("unbound") != nullptr);
  CHECK(f.kv.find("plain") != nullptr);
  CHECK_EQ(f.kv.revision(), before + 2);
  auto& r = f.ready();
  CHECK_EQ(r.size(), std::size_t{1});
  CHECK_EQ(r.at(0).conn, 2ull);
  CHECK(r.at(0).event == EventKind::Delete);
  CHECK_EQ(f.kv.waiter_count(), std::size_t{0});
}

TEST(barrier_generations_and_withdrawal) {
  Fixture f;
  f.kv.open_session(3);
  f.kv.barrier(1, 1, "b", 3, kNoTimeout);
  f.kv.barrier(2, 2, "b", 2, kNoTimeout);  // world size mismatch
  auto& e = f.ready();
  CHECK_EQ(e.size(), std::size_t{1});
  CHECK(e.at(0).status == Status::Error);
  f.kv.barrier(2, 3, "b", 3, 100);
  CHECK(f.ready().empty());
  f.kv.expire(g_now + 101);  // participant 2 times out and is withdrawn
  auto& t = f.ready();
  CHECK(t.at(0).status == Status::Timeout);
  CHECK_EQ(t.at(0).arrived, 2u);
  CHECK_EQ(t.at(0).world_size, 3u);
  f.kv.barrier(2, 4, "b", 3, kNoTimeout);
  f.kv.close_session(2);  // disconnect withdraws too
  f.kv.open_session(2);
  f.kv.barrier(2, 5, "b", 3, kNoTimeout);
  CHECK(f.ready().empty());
  f.kv.barrier(3, 6, "b", 3, kNoTimeout);
  auto& g0 = f.ready();
  CHECK_EQ(g0.size(), std::size_t{3});
  for (auto& c : g0) {
    CHECK(c.status == Status::Ok);
    CHECK_EQ(c.revision, 0ull);
  }
  // The next generation may use another world size.
  f.kv.barrier(1, 7, "b", 1, kNoTimeout);
  auto& g1 = f.ready();
  CHECK_EQ(g1.at(0).revision, 1ull);
  f.kv.barrier(1, 8, "b", 0, kNoTimeout);
  CHECK(f.ready().at(0).status == Status::Error);
}

TEST(queue_order_and_blocked_pops) {
  Fixture f;
  CHECK_EQ(f.kv.queue_push("q", "1"), int64_t{1});
  CHECK_EQ(f.kv.queue_push("q", "2"), int64_t{2});
  CHECK_EQ(f.kv.queue_len("q"), int64_t{2});
  f.kv.queue_pop(1, 1, "q", 0);
  CHECK_EQ(f.ready().at(0).values.at(0), std::string("1"));
  f.kv.queue_pop(1, 2, "q", 0);
  CHECK_EQ(f.ready().at(0).values.at(0), std::string("2"));
  CHECK_EQ(f.kv.queue_count(), std::size_t{0});
  f.kv.queue_pop(1, 3, "q", 0);
  CHECK(f.ready().at(0).status == Status::Timeout);
  f.kv.queue_pop(1, 4, "q", kNoTimeout);
  f.kv.queue_pop(2, 5, "q", kNoTimeout);
  CHECK(f.kv.find("q") == nullptr);  // queues are not keys
  CHECK_EQ(f.kv.queue_push("q", "a"), int64_t{0});
  auto& r = f.ready();
  CHECK_EQ(r.size(), std::size_t{1});
  CHECK_EQ(r.at(0).tag, 4ull);  // oldest blocked pop first
  f.kv.queue_push("q", "b");
  CHECK_EQ(f.ready().at(0).tag, 5ull);
}

TEST(list_keys_sorted_by_prefix) {
  Fixture f;
  for (const char* k : {"b/2", "a/1", "b/1", "c", "b"}) f.kv.set(1, k, "v", false);
  const auto keys = f.kv.list_keys("b/");
  CHECK_EQ(keys.size(), std::size_t{2});
  CHECK_EQ(*keys.at(0), std::string("b/1"));
  CHECK_EQ(*keys.at(1), std::string("b/2"));
  CHECK_EQ(f.kv.list_keys("").size(), std::size_t{5});
}

TEST(cancel_waiters_drops_silently) {
  Fixture f;
  f.kv.get(1, 1, "x", kNoTimeout);
  f.kv.queue_pop(1, 2, "q", 100);
  f.kv.watch(1, 3, "p", true, kWatchFromNow, kNoTimeout);
  f.kv.cancel_waiters(1);
  CHECK_EQ(f.kv.waiter_count(), std::size_t{0});
  CHECK_EQ(f.kv.next_deadline(), kNoDeadline);
  f.kv.set(1, "x", "1", false);
  f.kv.set(1, "p1", "1", false);
  f.kv.queue_push("q", "v");
  CHECK(f.ready().empty());
  CHECK_EQ(f.kv.queue_len("q"), int64_t{1});
}

TEST(multi_key_wait_counts_missing_keys_through_deletes) {
  Fixture f;
  f.kv.set(1, "a", "1", false);
  f.kv.wait(2, 1, SV{"a", "b", "c", "b"}, kNoTimeout);  // "b" twice: counted twice
  f.kv.erase("a");
  f.kv.set(1, "b", "1", false);
  f.kv.set(1, "c", "1", false);
  CHECK(f.ready().empty());  // "a" went missing meanwhile
  f.kv.erase("c");
  f.kv.set(1, "a", "2", false);
  CHECK(f.ready().empty());
  f.kv.set(1, "c", "2", false);
  CHECK_EQ(f.ready().size(), std::size_t{1});
  CHECK_EQ(f.kv.waiter_count(), std::size_t{0});
  f.kv.erase("a");  // no waiter left on any of the keys
  CHECK(f.ready().empty());
}

TEST(wait_counts_keys_and_non_empty_queues) {
  Fixture f;
  f.kv.wait(2, 1, SV{"k", "q"}, kNoTimeout, WaitKind::Wait);
  f.kv.queue_push("q", "item");  // "q" present as a queue
  std::string item;
  CHECK(f.kv.queue_try_pop("q", &item));  // and absent again
  f.kv.set(1, "k", "1", false);
  CHECK(f.ready().empty());
  f.kv.set(1, "q", "1", false);  // present as a key; a queue filling then changes nothing
  f.kv.queue_push("q", "x");
  CHECK_EQ(f.ready().size(), std::size_t{1});
  f.kv.erase("q");  // the queue still holds an item: "q" stays present
  CHECK(f.kv.check(SV{"q"}));
  f.kv.wait(2, 2, SV{"q"}, kNoTimeout);  // answered at once
  CHECK_EQ(f.ready().size(), std::size_t{1});
  CHECK(f.kv.queue_try_pop("q", &item));
  CHECK(!f.kv.check(SV{"q"}));
}

TEST(get_and_multi_get_wait_for_a_value_not_a_queue) {
  Fixture f;
  f.kv.queue_push("q", "item");
  CHECK(f.kv.check(SV{"q"}));
  CHECK_EQ(f.kv.num_keys(), std::size_t{0});  // a queue is not a stored key
  CHECK(!f.kv.erase("q"));                     // ... nor deleted as one
  f.kv.get(1, 1, "q", kNoTimeout);
  f.kv.wait(1, 2, SV{"q"}, kNoTimeout, WaitKind::MultiGet);
  CHECK(f.ready().empty());
  f.kv.queue_push("q", "more");
  CHECK(f.ready().empty());
  f.kv.set(1, "q", "v", false);
  CHECK_EQ(f.ready().size(), std::size_t{2});
  CHECK_EQ(f.kv.queue_len("q"), int64_t{2});
}

TEST(watchers_share_the_event_value) {
  Fixture f;
  f.kv.watch(1, 1, "w", false, kWatchFromNow, kNoTimeout);
  f.kv.watch(2, 2, "w", true, kWatchFromNow, kNoTimeout);
  f.kv.set(1, "w", std::string(1000, 'x'), false);
  auto& r = f.ready();
  CHECK_EQ(r.size(), std::size_t{2});
  CHECK(r.at(0).value != nullptr);
  CHECK(r.at(0).value == r.at(1).value);  // one copy for every watcher
  CHECK_EQ(r.at(0).value->size(), std::size_t{1000});
}

TEST(barrier_entries_are_erased_when_idle) {
  Fixture f;
  f.kv.barrier(1, 1, "t", 2, 50);  // times out alone at generation 0: nothing is kept
  CHECK_EQ(f.kv.barrier_count(), std::size_t{1});
  f.kv.expire(g_now + 51);
  CHECK(f.ready().at(0).status == Status::Timeout);
  CHECK_EQ(f.kv.barrier_count(), std::size_t{0});
  f.kv.barrier(1, 2, "t", 2, 0);  // non-blocking and not released: nothing is kept either
  CHECK(f.ready().at(0).status == Status::Timeout);
  CHECK_EQ(f.kv.barrier_count(), std::size_t{0});
  for (uint64_t g = 0; g < 3; ++g) {  // a reused name counts on
    f.kv.barrier(1, 3, "r", 2, kNoTimeout);
    f.kv.barrier(2, 4, "r", 2, kNoTimeout);
    auto& r = f.ready();
    CHECK_EQ(r.size(), std::size_t{2});
    CHECK_EQ(r.at(0).revision, g);
    CHECK_EQ(r.at(1).revision, g);
    CHECK_EQ(f.kv.barrier_count(), std::size_t{1});  // only its generation is kept
  }
  // A late arrival after a release starts the next generation, not the released one, even when
  // everyone of that next generation withdraws first.
  f.kv.barrier(1, 5, "r", 2, 50);
  f.kv.expire(g_now + 51);
  CHECK(f.ready().at(0).status == Status::Timeout);
  f.kv.barrier(1, 6, "r", 1, kNoTimeout);
  CHECK_EQ(f.ready().at(0).revision, 3ull);
  f.kv.barrier(1, 7, "one-shot", 1, kNoTimeout);
  CHECK_EQ(f.ready().at(0).revision, 0ull);
  CHECK_EQ(f.kv.barrier_count(), std::size_t{2});
}

TEST(idle_barrier_names_expire_and_are_capped) {
  StoreLimits limits;
  limits.barrier_idle_ms = 100;
  KvState kv{&fake_clock, limits};
  std::vector<Completion> done;
  kv.open_session(1);
  kv.barrier(1, 1, "a", 1, kNoTimeout);  // released at g_now: idle from now on
  g_now += 60;
  kv.barrier(1, 2, "b", 1, kNoTimeout);
  kv.expire_idle_barriers();
  CHECK_EQ(kv.barrier_count(), std::size_t{2});
  g_now += 40;  // "a" idle for 100 ms: forgotten; "b" for 40 ms: kept
  kv.expire_idle_barriers();
  CHECK_EQ(kv.barrier_count(), std::size_t{1});
  kv.take_ready(&done);
  kv.barrier(1, 3, "a", 1, kNoTimeout);  // starts again at generation 0
  kv.barrier(1, 4, "b", 1, kNoTimeout);  // counts on, and its idle time starts again
  kv.take_ready(&done);
  CHECK_EQ(done.at(0).revision, 0ull);
  CHECK_EQ(done.at(1).revision, 1ull);
  g_now += 99;
  kv.expire_idle_barriers();
  CHECK_EQ(kv.barrier_count(), std::size_t{2});
  g_now += 1;
  kv.barrier(1, 5, "c", 2, 0);  // any barrier request expires the idle ones first
  CHECK_EQ(kv.barrier_count(), std::size_t{0});
  // At most kMaxIdleBarrierNames idle names: the oldest are forgotten first.
  for (std::size_t i = 0; i < kMaxIdleBarrierNames + 10; ++i)
    kv.barrier(1, 6, "once-" + std::to_string(i), 1, kNoTimeout);
  CHECK_EQ(kv.barrier_count(), kMaxIdleBarrierNames);
  kv.take_ready(&done);
  kv.barrier(1, 7, "once-10", 1, kNoTimeout);  // the oldest kept: generation 1
  kv.barrier(1, 8, "once-9", 1, kNoTimeout);   // forgotten: generation 0 again
  kv.take_ready(&done);
  CHECK_EQ(done.at(0).revision, 1ull);
  CHECK_EQ(done.at(1).revision, 0ull);
  CHECK_EQ(kv.barrier_count(), kMaxIdleBarrierNames);
}

TEST(blocked_requests_are_bounded_per_connection) {
  Fixture f;
  std::vector<std::string> names;
  for (int i = 0; i < 10000; ++i) names.push_back("key-" + std::to_string(i));
  const SV keys(names.begin(), names.end());
  std::size_t parked = 0;
  for (uint64_t tag = 1; tag <= 100; ++tag) {
    f.kv.wait(1, tag, keys, kNoTimeout);
    if (!f.ready().empty()) {
      CHECK(f.done.at(0).status == Status::TooLarge);
      CHECK(f.done.at(0).key.find("per connection") != std::string::npos);
      break;
    }
    ++parked;
  }
  CHECK(parked > 10 && parked < 100);
  CHECK(f.kv.waiting_bytes() <= kMaxWaitingBytesPerConnection);
  f.kv.get(2, 1, "other", kNoTimeout);  // another connection still may block
  CHECK(f.ready().empty());
  f.kv.cancel_waiters(1);  // what a connection's requests held is given back
  f.kv.cancel_waiters(2);
  CHECK_EQ(f.kv.waiting_bytes(), std::size_t{0});
  f.kv.wait(1, 200, keys, kNoTimeout);
  CHECK(f.ready().empty());
}
