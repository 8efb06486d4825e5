// A growable byte buffer with a read offset: append at the back, consume from the front in O(1).
// Idle connections must cost little memory, so a buffer starts empty (std::string's inline bytes),
// compacts when the consumed prefix dominates, and drops its storage once drained if a big frame
// made it grow past kBufferKeepBytes.
#pragma once

#include <cstddef>
#include <string>

namespace elasticstore {

inline constexpr std::size_t kBufferKeepBytes = 64 * 1024;     // capacity kept after draining
inline constexpr std::size_t kBufferCompactMinBytes = 16 * 1024;  // consumed prefix worth moving
// Each loop reads into one shared scratch buffer of this size; connections keep only the
// incomplete tail of a request.
inline constexpr std::size_t kReadScratchBytes = 64 * 1024;

class Buffer {
 public:
  const char* data() const noexcept { return buf_.data() + off_; }
  std::size_t size() const noexcept { return buf_.size() - off_; }
  bool empty() const noexcept { return off_ == buf_.size(); }
  std::size_t capacity() const noexcept { return buf_.capacity(); }

  void append(const char* p, std::size_t n) { buf_.append(p, n); }
  // The backing string, for appending encoded frames (Writer) at its end.
  std::string& tail() noexcept { return buf_; }

  void consume(std::size_t n) noexcept {
    off_ += n;
    if (off_ >= buf_.size()) {
      clear();
    } else if (off_ >= kBufferCompactMinBytes && off_ * 2 >= buf_.size()) {
      buf_.erase(0, off_);
      off_ = 0;
    }
  }
  void clear() noexcept {
    buf_.clear();
    off_ = 0;
    if (buf_.capacity() > kBufferKeepBytes) std::string().swap(buf_);
  }

 private:
  std::string buf_;
  std::size_t off_ = 0;
};

}  // namespace elasticstore
