#include "wire/log.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>

namespace elasticstore {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::Warning)};
constexpr std::size_t kMaxLogLineBytes = 1024;  // longer lines are truncated, never allocated
}  // namespace

void set_log_level(LogLevel level) noexcept { g_level.store(static_cast<int>(level)); }
LogLevel log_level() noexcept { return static_cast<LogLevel>(g_level.load()); }
bool log_enabled(LogLevel level) noexcept {
  return level != LogLevel::Off && static_cast<int>(level) >= g_level.load(std::memory_order_relaxed);
}

void log(LogLevel level, const char* fmt, ...) noexcept {
  if (!log_enabled(level)) return;
  char line[kMaxLogLineBytes];
  static constexpr char kPrefix[] = "elasticstore: ";
  std::size_t n = sizeof kPrefix - 1;
  __builtin_memcpy(line, kPrefix, n);
  va_list ap;
  va_start(ap, fmt);
  const int w = std::vsnprintf(line + n, sizeof line - n - 1, fmt, ap);
  va_end(ap);
  if (w > 0) n += static_cast<std::size_t>(w) < sizeof line - n - 1 ? static_cast<std::size_t>(w)
                                                                     : sizeof line - n - 2;
  line[n++] = '\n';
  ssize_t rc = ::write(STDERR_FILENO, line, n);
  (void)rc;  // nowhere to report a failed log write
}

}  // namespace elasticstore
