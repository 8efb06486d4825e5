#include "client/stats.hpp"

#include <algorithm>
#include <atomic>

namespace elasticstore {
namespace call_stats {
namespace {

// One operation's counters, on cache lines of their own so that threads calling different
// operations do not share one.
struct alignas(64) Slot {
  std::array<std::atomic<uint64_t>, kOutcomes> calls{};
  std::atomic<uint64_t> total_ns{0};
  std::array<std::atomic<uint64_t>, kBuckets> buckets{};
};

// Indexed by opcode (0 is no opcode and stays unused).
std::array<Slot, kMaxOp + 1> g_slots;

std::size_t bucket_of(int64_t ns) {
  const auto it = std::lower_bound(kLatencyBoundsNs.begin(), kLatencyBoundsNs.end(), ns);
  return static_cast<std::size_t>(it - kLatencyBoundsNs.begin());
}


}  // namespace

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::Ok: return "ok";
    case Outcome::Timeout: return "timeout";
    case Outcome::Network: return "network";
    case Outcome::Error: return "error";
  }
  return "error";
}

void record(Op op, Outcome outcome, std::chrono::steady_clock::duration elapsed) {
  const auto index = static_cast<std::size_t>(op);
  if (index == 0 || index >= g_slots.size()) return;
  Slot& s = g_slots[index];
  const int64_t ns =
      std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count());
  s.calls[static_cast<std::size_t>(outcome)].fetch_add(1, std::memory_order_relaxed);
  s.total_ns.fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
  s.buckets[bucket_of(ns)].fetch_add(1, std::memory_order_relaxed);
}

std::vector<OpSnapshot> snapshot() {
  std::vector<OpSnapshot> out;
  for (std::size_t i = 1; i < g_slots.size(); ++i) {
    const Slot& s = g_slots[i];
    OpSnapshot snap;
    uint64_t calls = 0;
    for (std::size_t o = 0; o < kOutcomes; ++o) {
      snap.calls[o] = s.calls[o].load(std::memory_order_relaxed);
      calls += snap.calls[o];
    }
    if (calls == 0) continue;
    snap.op = op_info(static_cast<uint8_t>(i))->call_name;
    snap.total_ns = s.total_ns.load(std::memory_order_relaxed);
    for (std::size_t b = 0; b < kBuckets; ++b) {
      snap.buckets[b] = s.buckets[b].load(std::memory_order_relaxed);
    }
    out.push_back(std::move(snap));
  }
  return out;
}

}  // namespace call_stats
}  // namespace elasticstore
