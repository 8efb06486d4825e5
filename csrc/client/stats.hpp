// Process-wide statistics of the client's calls, per operation: how many ended in each outcome,
// their total time and a latency histogram with fixed buckets. Every Client of the process adds
// to the same table (a few relaxed atomic increments per call); snapshot() reads it at any time.
// C++17, no Python, no torch.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "wire/protocol.hpp"

namespace elasticstore {
namespace call_stats {

// How a call ended. Ok: it returned (a non-blocking queue_pop that found the queue empty
// included). Timeout: the server answered TIMEOUT (TimeoutError). Network: NetworkError (no
// connection, a lost one, no reply within the client's deadline, a closed client). Error: any
// other error (an error reply, a protocol violation, an interrupt, a compacted watch, a failed
// authentication).
enum class Outcome : uint8_t { Ok = 0, Timeout = 1, Network = 2, Error = 3 };
inline constexpr std::size_t kOutcomes = 4;
const char* outcome_name(Outcome o);

// The histogram's upper bounds (a call of d counts in the first bucket with d <= bound), in
// nanoseconds: 50 us to 60 s. One more bucket holds the calls above the last bound.
inline constexpr std::array<int64_t, 19> kLatencyBoundsNs = {
    50'000,        100'000,       250'000,        500'000,        1'000'000,
    2'500'000,     5'000'000,     10'000'000,     25'000'000,     50'000'000,
    100'000'000,   250'000'000,   500'000'000,    1'000'000'000,  2'500'000'000,
    5'000'000'000, 10'000'000'000, 30'000'000'000, 60'000'000'000,
};
inline constexpr std::size_t kBuckets = kLatencyBoundsNs.size() + 1;

// Connecting (a new client, clone() or a reconnect, handshake included) is counted under the
// slot of HELLO; every other operation under its opcode. A slot is named by its op's call name
// in ops.def ("connect" for HELLO).
inline constexpr Op kConnectSlot = Op::Hello;

// Adds one call of op that took elapsed and ended in outcome. Lock-free, callable from any thread.
void record(Op op, Outcome outcome, std::chrono::steady_clock::duration elapsed);

struct OpSnapshot {
  std::string op;  // the call name (ops.def): "set", "compare_set", "multi_get", ..., "connect"
  std::array<uint64_t, kOutcomes> calls{};  // by Outcome
  uint64_t total_ns = 0;                    // of every call, whatever its outcome
  std::array<uint64_t, kBuckets> buckets{};  // non-cumulative, the last above the last bound
};

// The operations called at least once, by opcode. Each counter is read on its own (relaxed):
// while calls are in flight, the buckets of an op may be a call ahead of or behind its calls.
std::vector<OpSnapshot> snapshot();

}  // namespace call_stats
}  // namespace elasticstore
