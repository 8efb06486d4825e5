#include "server/event_loop.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <system_error>

#include "wire/log.hpp"

namespace elasticstore {
namespace {
struct Later {
  template <typename T>
  bool operator()(const T& a, const T& b) const noexcept {
    return a.deadline != b.deadline ? a.deadline > b.deadline : a.id > b.id;
  }
};
uint32_t to_epoll(uint32_t mask) {
  return ((mask & kReadable) ? EPOLLIN : 0u) | ((mask & kWritable) ? EPOLLOUT : 0u);
}
}  // namespace

EventLoop::EventLoop() : events_(kMaxEventsPerPoll) {
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0) throw std::system_error(errno, std::generic_category(), "epoll_create1");
  wakefd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wakefd_ < 0) {
    const int err = errno;
    ::close(epfd_);
    throw std::system_error(err, std::generic_category(), "eventfd");
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wakefd_;
  if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, wakefd_, &ev) < 0) {
    const int err = errno;
    ::close(wakefd_);
    ::close(epfd_);
    throw std::system_error(err, std::generic_category(), "epoll_ctl(eventfd)");
  }
}

EventLoop::~EventLoop() {
  ::close(wakefd_);
  ::close(epfd_);
}

bool EventLoop::add(int fd, uint32_t events, FileProc proc, void* data) noexcept {
  if (fd < 0) return false;
  try {
    if (static_cast<std::size_t>(fd) >= files_.size()) files_.resize(static_cast<std::size_t>(fd) + 1);
  } catch (...) {
    return false;
  }
  epoll_event ev{};
  ev.events = to_epoll(events);
  ev.data.fd = fd;
  if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) < 0) return false;
  files_[static_cast<std::size_t>(fd)] = FileEvent{proc, data};
  return true;
}

bool EventLoop::modify(int fd, uint32_t events) noexcept {
  epoll_event ev{};
  ev.events = to_epoll(events);
  ev.data.fd = fd;
  return ::epoll_ctl(epfd_, EPOLL_CTL_MOD, fd, &ev) == 0;
}

void EventLoop::remove(int fd) noexcept {
  if (fd < 0 || static_cast<std::size_t>(fd) >= files_.size()) return;
  ::epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
  files_[static_cast<std::size_t>(fd)] = FileEvent{};
}

EventLoop::TimerId EventLoop::add_timer(uint64_t delay_ms, std::function<void()> fn) {
  const TimerId id = next_timer_++;
  timers_.emplace(id, std::move(fn));
  heap_.push_back(HeapEntry{now_ms() + delay_ms, id});
  std::push_heap(heap_.begin(), heap_.end(), Later{});
  return id;
}

bool EventLoop::cancel_timer(TimerId id) noexcept {
  if (timers_.erase(id) == 0) return false;
  // Cancelled entries stay in the heap until popped; rebuild when they dominate so a connection
  // storm that arms and cancels frame timers cannot grow the heap without bound.
  if (heap_.size() > 64 && heap_.size() > 2 * timers_.size()) {
    heap_.erase(std::remove_if(heap_.begin(), heap_.end(),
                               [this](const HeapEntry& e) { return !timers_.count(e.id); }),
                heap_.end());
    std::make_heap(heap_.begin(), heap_.end(), Later{});
  }
  return true;
}

uint64_t EventLoop::now_ms() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000u + static_cast<uint64_t>(ts.tv_nsec) / 1000000u;
}

int EventLoop::poll_timeout_ms() const noexcept {
  if (heap_.empty()) return -1;
  const uint64_t now = now_ms();
  const uint64_t next = heap_.front().deadline;  // may be a cancelled entry: an early wake-up only
  if (next <= now) return 0;
  const uint64_t d = next - now;
  return d > 60'000 ? 60'000 : static_cast<int>(d);
}

void EventLoop::process_timers() {
  const uint64_t now = now_ms();
  while (!heap_.empty() && heap_.front().deadline <= now) {
    std::pop_heap(heap_.begin(), heap_.end(), Later{});
    const TimerId id = heap_.back().id;
    heap_.pop_back();
    auto it = timers_.find(id);
    if (it == timers_.end()) continue;  // cancelled
    std::function<void()> fn = std::move(it->second);
    timers_.erase(it);
    fn();
  }
}

void EventLoop::run() {
  uint64_t awake = 0;  // when the current pass began (0: before the first wait)
  while (!stop_.load(std::memory_order_acquire)) {
    if (before_sleep_) before_sleep_();
    if (stop_.load(std::memory_order_acquire)) break;
    const int timeout = poll_timeout_ms();
    const uint64_t asleep = now_ms();
    if (awake != 0) slowest_pass_ms_ = std::max(slowest_pass_ms_, asleep - awake);
    const int n = ::epoll_wait(epfd_, events_.data(), static_cast<int>(events_.size()), timeout);
    awake = now_ms();
    // Ended by its timeout, or by a stop and continue (EINTR without a handler), past the timeout.
    if (n <= 0 && timeout >= 0 && awake - asleep > static_cast<uint64_t>(timeout)) {
      latest_wake_ms_ = std::max(latest_wake_ms_, awake - asleep - static_cast<uint64_t>(timeout));
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      log(LogLevel::Error, "epoll_wait failed (errno %d); stopping the event loop", errno);
      break;
    }
    for (int i = 0; i < n; ++i) {
      const int fd = events_[static_cast<std::size_t>(i)].data.fd;
      const uint32_t ev = events_[static_cast<std::size_t>(i)].events;
      if (fd == wakefd_) {
        uint64_t v;
        ssize_t rc = ::read(wakefd_, &v, sizeof v);
        (void)rc;  // the flag, not the counter, carries the request
        continue;
      }
      if (static_cast<std::size_t>(fd) >= files_.size()) continue;
      const FileEvent fe = files_[static_cast<std::size_t>(fd)];
      if (!fe.proc) continue;  // removed earlier in this batch
      uint32_t mask = 0;
      if (ev & (EPOLLIN | EPOLLERR | EPOLLHUP)) mask |= kReadable;
      if (ev & (EPOLLOUT | EPOLLERR | EPOLLHUP)) mask |= kWritable;
      fe.proc(*this, fd, fe.data, mask);
    }
    process_timers();
  }
}

void EventLoop::stop() noexcept {
  stop_.store(true, std::memory_order_release);
  const uint64_t one = 1;
  ssize_t rc = ::write(wakefd_, &one, sizeof one);
  (void)rc;  // EAGAIN means the counter is already non-zero: the loop wakes anyway
}

}  // namespace elasticstore
