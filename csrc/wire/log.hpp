// Level-filtered logging to stderr. One process-wide level; the Server sets it from its config.
#pragma once

namespace elasticstore {

enum class LogLevel : int { Debug = 0, Info = 1, Warning = 2, Error = 3, Off = 4 };

void set_log_level(LogLevel level) noexcept;
LogLevel log_level() noexcept;
bool log_enabled(LogLevel level) noexcept;

// printf-style; each call emits one line prefixed "elasticstore: " with a single write(2), so lines
// from several threads never interleave.
void log(LogLevel level, const char* fmt, ...) noexcept __attribute__((format(printf, 2, 3)));

}  // namespace elasticstore
