// KvState's blocking operations (see kv_state.hpp): GET, WAIT/MULTI_GET, QUEUE_POP, BARRIER and
// WATCH, answered at once when they can be and parked as waiters (kv_waiters.cpp) otherwise.
#include "server/kv_state.hpp"

#include <algorithm>

namespace elasticstore {

// ---- blocking operations -----------------------------------------------------------------------

void KvState::get(ConnId conn, uint64_t tag, std::string_view key, uint32_t timeout_ms) {
  if (find(key)) {
    Completion c = make(conn, tag, WaitKind::Get, Status::Ok);
    c.key.assign(key);  // the codec reads the value when it encodes the reply
    ready_.push_back(std::move(c));
  } else if (timeout_ms == 0) {
    ready_.push_back(make(conn, tag, WaitKind::Get, Status::Timeout));
  } else if (const std::size_t charge = charge_for(1, key.size());
             !refuse_park(conn, tag, WaitKind::Get, charge)) {
    const WaiterId id = park(conn, tag, WaitKind::Get, timeout_ms, {std::string(key)}, charge);
    Waiter& w = waiters_.at(id);
    link(id, w, Index::Key, w.keys[0]);
  }
}

void KvState::wait(ConnId conn, uint64_t tag, const std::vector<std::string_view>& keys,
                   uint32_t timeout_ms, WaitKind kind) {
  std::size_t missing = 0;
  for (auto k : keys) missing += !present(k, kind);
  if (missing == 0) {
    Completion c = make(conn, tag, kind, Status::Ok);
    if (kind == WaitKind::MultiGet) c.values.assign(keys.begin(), keys.end());  // names only
    ready_.push_back(std::move(c));
  } else if (timeout_ms == 0) {
    Completion c = make(conn, tag, kind, Status::Timeout);
    for (auto k : keys)
      if (!present(k, kind)) c.values.emplace_back(k);
    ready_.push_back(std::move(c));
  } else {
    std::size_t key_bytes = 0;
    for (auto k : keys) key_bytes += k.size();
    const std::size_t charge = charge_for(keys.size(), key_bytes);
    if (refuse_park(conn, tag, kind, charge)) return;
    const WaiterId id = park(conn, tag, kind, timeout_ms,
                             std::vector<std::string>(keys.begin(), keys.end()), charge);
    Waiter& w = waiters_.at(id);
    w.missing = missing;
    link(id, w, Index::Keys, w.keys[0]);
  }
}

void KvState::queue_pop(ConnId conn, uint64_t tag, std::string_view queue, uint32_t timeout_ms) {
  std::string item;
  if (queue_try_pop(queue, &item)) {
    Completion c = make(conn, tag, WaitKind::QueuePop, Status::Ok);
    c.values.push_back(std::move(item));
    ready_.push_back(std::move(c));
  } else if (timeout_ms == 0) {
    ready_.push_back(make(conn, tag, WaitKind::QueuePop, Status::Timeout));
  } else if (const std::size_t charge = charge_for(1, queue.size());
             !refuse_park(conn, tag, WaitKind::QueuePop, charge)) {
    const WaiterId id =
        park(conn, tag, WaitKind::QueuePop, timeout_ms, {std::string(queue)}, charge);
    Waiter& w = waiters_.at(id);
    link(id, w, Index::Pop, w.keys[0]);
  }
}

// An entry in barriers_ exists only while someone waits; when the last waiter leaves (released,
// timed out or disconnected) it is erased, and a name released at least once keeps its next
// generation, so that reusing it (or arriving late, after a release) counts on from there.
// An idle name is kept only barrier_idle_ms after its last arrival, and at most
// kMaxIdleBarrierNames of them, oldest forgotten first: one-shot names cannot grow the server.
void KvState::barrier_idle(const std::string& name) {
  auto it = barriers_.find(name);
  if (it == barriers_.end() || !it->second.arrived.empty()) return;
  const uint64_t generation = it->second.generation;
  barriers_.erase(it);
  if (generation > 0) barrier_released(name, generation);
}

void KvState::barrier_released(const std::string& name, uint64_t generation) {
  auto [it, added] = barrier_generations_.try_emplace(name);
  IdleBarrier& idle = it->second;
  if (added) {
    idle.pos = idle_barriers_.insert(idle_barriers_.end(), name);
  } else {
    idle_barriers_.splice(idle_barriers_.end(), idle_barriers_, idle.pos);
  }
  idle.generation = generation;
  idle.last_ms = clock_();
  while (idle_barriers_.size() > kMaxIdleBarrierNames) {
    barrier_generations_.erase(idle_barriers_.front());
    idle_barriers_.pop_front();
  }
}

void KvState::expire_idle_barriers() {
  const uint64_t now_ms = clock_();
  while (!idle_barriers_.empty()) {
    auto it = barrier_generations_.find(idle_barriers_.front());
    if (now_ms - it->second.last_ms < limits_.barrier_idle_ms) return;
    barrier_generations_.erase(it);
    idle_barriers_.pop_front();
  }
}

void KvState::barrier(ConnId conn, uint64_t tag, std::string_view key, uint32_t world_size,
                      uint32_t timeout_ms) {
  auto reply = [&](Status s, uint64_t generation, uint32_t arrived, std::string msg) {
    Completion c = make(conn, tag, WaitKind::Barrier, s);
    c.revision = generation;
    c.arrived = arrived;
    c.world_size = world_size;
    c.key = std::move(msg);
    ready_.push_back(std::move(c));
  };
  if (world_size == 0) return reply(Status::Error, 0, 0, "barrier world_size must be at least 1");
  const std::string name(key);
  const std::size_t charge = charge_for(1, key.size());
  expire_idle_barriers();
  auto it = barriers_.find(name);
  if (it == barriers_.end()) {  // nobody waits: a new generation starts with this arrival
    auto g = barrier_generations_.find(name);
    const uint64_t generation = g == barrier_generations_.end() ? 0 : g->second.generation;
    if (world_size == 1) {
      barrier_released(name, generation + 1);
      return reply(Status::Ok, generation, 0, {});
    }
    if (timeout_ms == 0) return reply(Status::Timeout, 0, 1, {});
    if (refuse_park(conn, tag, WaitKind::Barrier, charge)) return;
    if (g != barrier_generations_.end()) {
      idle_barriers_.erase(g->second.pos);
      barrier_generations_.erase(g);
    }
    Barrier& b = barriers_[name];
    b.generation = generation;
    b.world_size = world_size;
  } else {
    Barrier& b = it->second;
    if (b.world_size != world_size)
      return reply(Status::Error, 0, 0,
                   "barrier world_size mismatch: " + std::to_string(world_size) + " given, " +
                       std::to_string(b.world_size) + " in progress");
    if (b.arrived.size() + 1 >= world_size) {
      const uint64_t generation = b.generation++;
      const std::vector<WaiterId> ids(b.arrived.begin(), b.arrived.end());
      for (WaiterId id : ids) {  // the last one out erases the entry (barrier_idle)
        const Waiter& w = waiters_.at(id);
        Completion c = make(w.conn, w.tag, w.kind, Status::Ok);
        c.revision = generation;
        finish(id, std::move(c));
      }
      return reply(Status::Ok, generation, 0, {});
    }
    if (timeout_ms == 0)
      return reply(Status::Timeout, 0, static_cast<uint32_t>(b.arrived.size() + 1), {});
    if (refuse_park(conn, tag, WaitKind::Barrier, charge)) return;
  }
  const WaiterId id = park(conn, tag, WaitKind::Barrier, timeout_ms, {name}, charge);
  Waiter& w = waiters_.at(id);
  link(id, w, Index::Barrier, w.keys[0]);
}

const HistoryEvent* KvState::first_match(const std::string& key, bool prefix,
                                         uint64_t after) const {
  if (history_.empty() || after >= revision_) return nullptr;
  const uint64_t front = history_.front().revision;  // revisions in history are contiguous
  // The next kWatchScanEvents events first: a watcher that catches up event by event, or one
  // near the end, finds its match there at the cost of the events it passes.
  const std::size_t start = after < front ? 0 : after - front + 1;
  const std::size_t scanned = std::min<std::size_t>(history_.size(), start + kWatchScanEvents);
  for (std::size_t i = start; i < scanned; ++i) {
    const HistoryEvent& ev = history_[i];
    if (prefix ? ev.key.compare(0, key.size(), key) == 0 && ev.key.size() >= key.size()
               : ev.key == key)
      return &ev;
  }
  if (scanned == history_.size()) return nullptr;
  // None there: the first later revision of the key, or of each key under the prefix.
  uint64_t first = 0;
  auto consider = [&](const std::deque<uint64_t>& revisions) {
    auto it = std::upper_bound(revisions.begin(), revisions.end(), after);
    if (it != revisions.end() && (first == 0 || *it < first)) first = *it;
  };
  if (!prefix) {
    if (auto it = history_by_key_.find(key); it != history_by_key_.end()) consider(it->second);
  } else {
    for (auto it = history_by_key_.lower_bound(key);
         it != history_by_key_.end() && it->first.compare(0, key.size(), key) == 0; ++it)
      consider(it->second);
  }
  return first == 0 ? nullptr : &history_[first - front];
}

void KvState::watch(ConnId conn, uint64_t tag, std::string_view key, bool is_prefix,
                    uint64_t after_revision, uint32_t timeout_ms) {
  const uint64_t after = after_revision == kWatchFromNow ? revision_ : after_revision;
  Completion c = make(conn, tag, WaitKind::Watch, Status::Ok);
  if (after < compacted_through_) {
    c.status = Status::Compacted;
    c.revision = history_.empty() ? revision_ + 1 : history_.front().revision;
  } else if (const HistoryEvent* ev = first_match(std::string(key), is_prefix, after)) {
    c.event = ev->kind;
    c.key = ev->key;
    c.value = ev->value;
    c.revision = ev->revision;
  } else if (timeout_ms == 0) {
    c.status = Status::Timeout;
    c.revision = revision_;
  } else if (const std::size_t charge = charge_for(1, key.size());
             refuse_park(conn, tag, WaitKind::Watch, charge)) {
    return;
  } else {
    const WaiterId id = park(conn, tag, WaitKind::Watch, timeout_ms, {std::string(key)}, charge);
    Waiter& w = waiters_.at(id);
    w.after = after;
    link(id, w, is_prefix ? Index::WatchPrefix : Index::WatchKey, w.keys[0]);
    return;
  }
  ready_.push_back(std::move(c));
}

}  // namespace elasticstore
