// KvState's store accounting (stored_entries/stored_bytes against max_stored_*) and its
// max_waiters_per_connection: every change keeps the totals equal to a recount.
#include <string>
#include <vector>

#include "check.hpp"
#include "server/kv_state.hpp"

using namespace elasticstore;

namespace {
uint64_t zero_clock() { return 0; }

// What the totals must be: keys plus queued items, and their key/name plus value bytes.
void check_totals(const KvState& kv, std::size_t entries, std::size_t bytes) {
  CHECK_EQ(kv.stored_entries(), entries);
  CHECK_EQ(kv.stored_bytes(), bytes);
}
}  // namespace

TEST(totals_follow_every_change) {
  KvState kv(&zero_clock);
  kv.open_session(1);
  kv.set(1, "ab", "xyz", false);  // 2 + 3
  check_totals(kv, 1, 5);
  kv.set(1, "ab", "x", false);  // replaced, shrinks
  check_totals(kv, 1, 3);
  uint64_t rev = 0;
  CHECK(kv.append("ab", "12", &rev) == Status::Ok);
  check_totals(kv, 1, 5);
  int64_t v = 0;
  CHECK(kv.add("n", 42, &v) == Status::Ok);  // "n" + "42"
  check_totals(kv, 2, 8);
  CHECK(kv.add("n", -40, &v) == Status::Ok);  // "2"
  check_totals(kv, 2, 7);
  kv.queue_push("q", "item");  // "q" + "item"
  kv.queue_push("q", "i2");
  check_totals(kv, 4, 7 + 5 + 3);
  std::string out;
  CHECK(kv.queue_try_pop("q", &out));
  check_totals(kv, 3, 7 + 3);
  CHECK(kv.erase("ab"));
  check_totals(kv, 2, 2 + 3);
  kv.compare_set(1, "e", "", "val", true);  // ephemeral: "e" + "val"
  check_totals(kv, 3, 9);
  kv.close_session(1);  // its key goes
  check_totals(kv, 2, 5);
}

TEST(fits_reports_which_limit) {
  StoreLimits lim;
  lim.max_stored_keys = 2;
  lim.max_stored_bytes = 20;
  KvState kv(&zero_clock, lim);
  kv.open_session(1);
  std::string why;
  CHECK(kv.fits("a", 5, &why));
  kv.set(1, "a", "12345", false);
  CHECK(kv.fits("a", 19, &why));  // replace: 1 + 19
  CHECK(!kv.fits("a", 20, &why));
  CHECK(why.find("max_stored_bytes") != std::string::npos);
  kv.set(1, "b", "1", false);
  CHECK(!kv.fits("c", 1, &why));
  CHECK(why.find("max_stored_keys") != std::string::npos);
  CHECK(!kv.fits_queue_item("q", 1, &why));
  CHECK(kv.fits_all({{"a", "1"}, {"b", "2"}}, &why));
  CHECK(!kv.fits_all({{"a", "1"}, {"z", "2"}}, &why));
}

TEST(waiters_per_connection_is_a_count) {
  StoreLimits lim;
  lim.max_waiters_per_connection = 2;
  KvState kv(&zero_clock, lim);
  kv.open_session(1);
  kv.open_session(2);
  kv.get(1, 1, "x", kNoTimeout);
  kv.get(1, 2, "y", kNoTimeout);
  kv.get(1, 3, "z", kNoTimeout);
  kv.get(2, 4, "z", kNoTimeout);  // another session has its own allowance
  std::vector<Completion> done;
  CHECK(kv.take_ready(&done));
  CHECK_EQ(done.size(), std::size_t{1});
  CHECK(done[0].tag == 3 && done[0].status == Status::TooLarge);
  CHECK_EQ(kv.waiter_count(), std::size_t{3});
  kv.close_session(1);
  kv.close_session(2);
  CHECK_EQ(kv.waiter_count(), std::size_t{0});
}
