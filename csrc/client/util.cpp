// Small helpers of the client (client_detail in transport.hpp): error texts, time
// formatting, deadlines, the fork() counter and random seeds.
#include <pthread.h>
#include <sys/random.h>
#include <sys/types.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "client/transport.hpp"

namespace elasticstore {

namespace client_detail {

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns the message pointer (maybe not buf).
  const char* s = strerror_r(err, buf, sizeof buf);
  return s ? std::string(s) : std::string("errno ") + std::to_string(err);
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string fmt_seconds(double s) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f s", s);
  return buf;
}

std::string quote(std::string_view s) {
  constexpr std::size_t kMax = 96;
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size() && i < kMax; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > kMax) out += "...";
  out += '"';
  return out;
}

Clock::time_point deadline_after(Clock::time_point from, Timeout t) {
  // Negative, or so long that the clock arithmetic could overflow: no deadline.
  if (t.count() < 0 || t > std::chrono::hours(24 * 365 * 10)) return Clock::time_point::max();
  return from + t;
}

namespace {
std::atomic<uint64_t> g_fork_generation{1};
void on_fork_child() { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

uint64_t fork_generation() {
  static std::once_flag atfork_once;
  std::call_once(atfork_once, [] { ::pthread_atfork(nullptr, nullptr, on_fork_child); });
  return g_fork_generation.load(std::memory_order_relaxed);
}

uint32_t random_seed() {
  // One getrandom() call: cheaper than a std::random_device (an open device or a CPU
  // instruction loop per construction), made twice per client before.
  uint32_t seed = 0;
  if (::getrandom(&seed, sizeof seed, GRND_NONBLOCK) != static_cast<ssize_t>(sizeof seed)) {
    static std::atomic<uint32_t> fallback{0x9e3779b9u};
    seed = fallback.fetch_add(0x6d2b79f5u, std::memory_order_relaxed) ^
           static_cast<uint32_t>(Clock::now().time_since_epoch().count());
  }
  return seed;
}

}  // namespace client_detail

}  // namespace elasticstore
