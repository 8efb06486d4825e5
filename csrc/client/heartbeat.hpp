// A session-bound key kept fresh by a thread of its own (no Python, no GIL): a process that is
// busy (an interpreter whose threads contend for the GIL) still refreshes it on time, while a
// stopped or cut-off one does not, so a watcher can judge it silent by the key not changing.
// An optional presence key on the same session is created when missing and otherwise left
// alone: watchers of it see its creation and deletion only, never a beat.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "client/client.hpp"

namespace elasticstore {

class Heartbeat {
 public:
  // Sets `key` (bound to `client`'s session) to "<value> <n>" now, n = 1 (throws as
  // Client::set), then every `period` from the thread, n counting up; each beat also creates
  // `presence` (when not empty) with `value` if it is missing. Owns `client`.
  Heartbeat(std::unique_ptr<Client> client, std::string key, std::string value, Timeout period,
            std::string presence = {});
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // One beat now, on the caller's thread (throws as Client::set).
  void beat();
  // Beats made so far (the thread's included).
  uint64_t beats() const { return beats_.load(std::memory_order_relaxed); }
  // Stops the thread at once (a beat in progress is aborted) and closes the connection, which
  // ends the session and so deletes the key on the server. Idempotent; never throws.
  void stop() noexcept;

 private:
  void run() noexcept;

  std::unique_ptr<Client> client_;
  const std::string key_;
  const std::string value_;
  const std::string presence_;
  const Timeout period_;
  std::atomic<uint64_t> beats_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace elasticstore
