// A single-threaded epoll event loop in the spirit of Redis ae.c: file events with a plain
// callback + user pointer, one-shot timers on a monotonic clock (a min-heap with cancellation), a
// before-sleep hook, and an eventfd so another thread can stop the loop.
//
// Level-triggered: a handler may read once (one scratch buffer's worth) and return; epoll reports
// the fd again while bytes remain. That bounds the work per connection per iteration (fairness
// under load), needs no "drain to EAGAIN" discipline that edge-triggered mode punishes with hangs
// when forgotten, and EPOLLOUT is only requested while a write is blocked, so it does not spin.
#pragma once

#include <sys/epoll.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

namespace elasticstore {

inline constexpr uint32_t kReadable = 1;
inline constexpr uint32_t kWritable = 2;
inline constexpr int kMaxEventsPerPoll = 256;

class EventLoop {
 public:
  // `events` is a mask of kReadable/kWritable; errors and hang-ups are reported as both.
  using FileProc = void (*)(EventLoop& loop, int fd, void* data, uint32_t events);
  using TimerId = uint64_t;

  EventLoop();  // throws std::system_error (runs on the caller's thread, not in the loop)
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  bool add(int fd, uint32_t events, FileProc proc, void* data) noexcept;
  bool modify(int fd, uint32_t events) noexcept;
  // Safe from inside a callback of the same batch: later events for fd are skipped.
  void remove(int fd) noexcept;

  TimerId add_timer(uint64_t delay_ms, std::function<void()> fn);
  bool cancel_timer(TimerId id) noexcept;
  std::size_t timer_count() const noexcept { return timers_.size(); }

  void set_before_sleep(std::function<void()> fn) { before_sleep_ = std::move(fn); }

  void run();             // until stop(); call from one thread only
  void stop() noexcept;   // from any thread
  static uint64_t now_ms() noexcept;

  // Since the start, in ms: the longest pass (from a wake-up to the next wait: the events and
  // timers handled, the work before sleeping), and the latest a wait that ended by its timeout
  // returned past that timeout (the process not scheduled: a starved or stopped server). Read
  // on the loop's thread.
  uint64_t slowest_pass_ms() const noexcept { return slowest_pass_ms_; }
  uint64_t latest_wake_ms() const noexcept { return latest_wake_ms_; }

 private:
  struct FileEvent {
    FileProc proc = nullptr;
    void* data = nullptr;
  };
  struct HeapEntry {
    uint64_t deadline;
    TimerId id;
  };
  void process_timers();
  int poll_timeout_ms() const noexcept;

  int epfd_ = -1;
  int wakefd_ = -1;
  std::atomic<bool> stop_{false};
  std::vector<FileEvent> files_;  // indexed by fd
  std::vector<HeapEntry> heap_;   // min-heap on deadline; cancelled entries are skipped lazily
  std::unordered_map<TimerId, std::function<void()>> timers_;
  TimerId next_timer_ = 1;
  std::function<void()> before_sleep_;
  std::vector<epoll_event> events_;
  uint64_t slowest_pass_ms_ = 0;
  uint64_t latest_wake_ms_ = 0;
};

}  // namespace elasticstore
