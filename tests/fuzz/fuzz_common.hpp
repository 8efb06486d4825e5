// Shared by the fuzz targets: a fuzz-input splitter and a harness that drives a codec over a
// KvState the way a Connection does (step until NeedMore/Close, then encode the completions).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "server/codec.hpp"

namespace elasticstore::fuzz {

// Aborts (a finding) when an invariant does not hold.
#define FUZZ_ASSERT(cond)                                                       \
  do {                                                                          \
    if (!(cond)) {                                                              \
      __builtin_fprintf(stderr, "invariant failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                             \
    }                                                                           \
  } while (0)

class NoStats final : public StatsSource {
 public:
  StatsList stats_snapshot() const override { return {{"requests", 1}}; }
};

// Feeds `input` to `codec` in chunks whose sizes come from `cuts` (each a byte of the input's
// first part), as a socket would deliver it. Returns the number of requests handled.
inline std::size_t drive(Codec& codec, KvState& kv, ConnId conn, const std::string& input,
                         const uint8_t* cuts, std::size_t ncuts, bool* closed) {
  NoStats stats;
  ServerAuth auth{"", PeerAllowList(true, {})};  // no token: every opcode after HELLO
  std::string out, pending, completions;
  std::size_t handled = 0, fed = 0, cut = 0;
  *closed = false;
  std::vector<Completion> ready;
  while (fed < input.size() && !*closed) {
    const std::size_t step_bytes = ncuts ? 1 + cuts[cut++ % ncuts] : input.size();
    const std::size_t n = std::min(step_bytes, input.size() - fed);
    pending.append(input, fed, n);
    fed += n;
    for (;;) {
      CommandContext ctx{kv, conn, out, stats, auth};
      std::size_t consumed = 0;
      std::string reason;
      const Step s = codec.step(ctx, pending.data(), pending.size(), &consumed, &reason);
      if (s == Step::NeedMore) break;
      if (s == Step::Close) {
        FUZZ_ASSERT(!reason.empty());  // every close is logged with a reason
        *closed = true;
        break;
      }
      FUZZ_ASSERT(consumed > 0 && consumed <= pending.size());
      pending.erase(0, consumed);
      ++handled;
      while (kv.take_ready(&ready)) {
        for (const Completion& c : ready) {
          std::string why;
          codec.complete(c, kv, completions, kMaxWriteBufferBytes, &why);
        }
      }
      if (out.size() > (std::size_t{1} << 20)) out.clear();  // replies are not the subject here
      if (completions.size() > (std::size_t{1} << 20)) completions.clear();
    }
  }
  return handled;
}

}  // namespace elasticstore::fuzz
