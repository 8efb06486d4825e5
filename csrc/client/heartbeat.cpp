// See heartbeat.hpp.
#include "client/heartbeat.hpp"

#include <utility>

namespace elasticstore {

Heartbeat::Heartbeat(std::unique_ptr<Client> client, std::string key, std::string value,
                     Timeout period, std::string presence)
    : client_(std::move(client)), key_(std::move(key)), value_(std::move(value)),
      presence_(std::move(presence)), period_(period.count() > 0 ? period : Timeout(1)) {
  beat();  // the key exists before the constructor returns
  thread_ = std::thread([this] { run(); });
}

Heartbeat::~Heartbeat() { stop(); }

void Heartbeat::beat() {
  const uint64_t n = beats_.fetch_add(1, std::memory_order_relaxed) + 1;
  client_->set(key_, value_ + " " + std::to_string(n), /*ephemeral=*/true);
  // Back at once after a reconnect (a new session) or a watcher's delete; no change otherwise.
  if (!presence_.empty()) client_->compare_set(presence_, "", value_, /*ephemeral=*/true);
}

void Heartbeat::run() noexcept {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (cv_.wait_for(lock, period_, [this] { return stopping_; })) return;
    lock.unlock();
    try {
      beat();
    } catch (const std::exception&) {
      // Retried next period (a call after a lost connection reconnects); a store that is gone
      // for good is reported by the caller's own calls.
    }
    lock.lock();
  }
}

void Heartbeat::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  try {
    client_->close();  // aborts a beat in progress; the session (and its key) ends
  } catch (const std::exception&) {
  }
  if (thread_.joinable()) thread_.join();
}

}  // namespace elasticstore
