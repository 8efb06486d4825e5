// KvState's waiters (see kv_state.hpp): parking, linking by key and by connection, waking on
// changes, expiry by deadline, and the blocking operations built on them. The data operations are
// in kv_state.cpp.
#include "server/kv_state.hpp"

namespace elasticstore {

// ---- notifications -----------------------------------------------------------------------------

void KvState::notify_watchers(const HistoryEvent& ev) {
  std::vector<WaiterId> hit;
  if (auto it = watch_keys_.find(ev.key); it != watch_keys_.end())
    hit.insert(hit.end(), it->second.begin(), it->second.end());
  for (const auto& [len, count] : prefix_lengths_) {
    if (len > ev.key.size()) break;
    auto it = watch_prefixes_.find(std::string_view(ev.key).substr(0, len));
    if (it != watch_prefixes_.end()) hit.insert(hit.end(), it->second.begin(), it->second.end());
  }
  for (WaiterId id : hit) {
    const Waiter& w = waiters_.at(id);
    if (ev.revision <= w.after) continue;
    Completion c = make(w.conn, w.tag, w.kind, Status::Ok);
    c.event = ev.kind;
    c.key = ev.key;
    c.value = ev.value;  // shared: N watchers of one event cost one copy of its value
    c.revision = ev.revision;
    finish(id, std::move(c));
  }
}

void KvState::key_created(const std::string& key) {
  auto it = key_waiters_.find(key);
  if (it == key_waiters_.end()) return;
  std::vector<WaiterId> gets;
  for (WaiterId id : it->second)
    if (waiters_.at(id).kind == WaitKind::Get) gets.push_back(id);
  for (WaiterId id : gets) {
    const Waiter& w = waiters_.at(id);
    Completion c = make(w.conn, w.tag, w.kind, Status::Ok);
    c.key = key;  // the codec reads the value when it encodes the reply
    finish(id, std::move(c));
  }
  presence_changed(key, true, Affects::Both);
}

void KvState::key_deleted(const std::string& key) { presence_changed(key, false, Affects::Both); }

void KvState::queue_filled(const std::string& queue) {
  presence_changed(queue, true, Affects::Queue);
}
void KvState::queue_drained(const std::string& queue) {
  presence_changed(queue, false, Affects::Queue);
}

// A key's creation or deletion changes presence for plain waits, and for WaitOrQueue unless a
// queue of that name holds items; a queue filling or draining changes it for WaitOrQueue unless
// the key exists. Each Keys waiter is listed once per occurrence of the name in its request.
void KvState::presence_changed(const std::string& name, bool now_present, Affects affects) {
  auto it = key_waiters_.find(name);
  if (it == key_waiters_.end()) return;
  const bool other_holds =
      affects == Affects::Queue ? find(name) != nullptr : queue_len(name) > 0;  // WaitOrQueue
  std::vector<WaiterId> done;
  for (WaiterId id : it->second) {
    Waiter& w = waiters_.at(id);
    if (w.index != Index::Keys) continue;
    const bool or_queue = w.kind == WaitKind::WaitOrQueue;
    if (or_queue ? other_holds : affects == Affects::Queue) continue;
    if (now_present) {
      if (--w.missing == 0) done.push_back(id);
    } else {
      ++w.missing;
    }
  }
  for (WaiterId id : done) finish(id, keys_ready(waiters_.at(id)));
}

Completion KvState::keys_ready(const Waiter& w) const {
  Completion c = make(w.conn, w.tag, w.kind, Status::Ok);
  if (w.kind == WaitKind::MultiGet) c.values = w.keys;  // names; the codec reads the values
  return c;
}

// ---- waiter bookkeeping ------------------------------------------------------------------------

Completion KvState::make(ConnId conn, uint64_t tag, WaitKind kind, Status status) const {
  Completion c;
  c.conn = conn;
  c.tag = tag;
  c.kind = kind;
  c.status = status;
  return c;
}

uint64_t KvState::deadline_for(uint32_t timeout_ms) const {
  return timeout_ms == kNoTimeout ? kNoDeadline : clock_() + timeout_ms;
}

std::size_t KvState::charge_for(std::size_t nkeys, std::size_t key_bytes) noexcept {
  return kWaiterOverheadBytes + nkeys * kWaiterKeyOverheadBytes + 2 * key_bytes;
}

bool KvState::refuse_park(ConnId conn, uint64_t tag, WaitKind kind, std::size_t charge) {
  const Session& session = sessions_[conn];
  if (session.waiters.size() >= limits_.max_waiters_per_connection) {
    Completion c = make(conn, tag, kind, Status::TooLarge);
    c.key = "the connection has " + std::to_string(session.waiters.size()) +
            " blocked requests, the limit (max_waiters_per_connection)";
    ready_.push_back(std::move(c));
    return true;
  }
  const std::size_t mine = session.waiting_bytes;
  const bool own = mine + charge > kMaxWaitingBytesPerConnection;
  if (!own && waiting_bytes_ + charge <= kMaxWaitingBytes) return false;
  Completion c = make(conn, tag, kind, Status::TooLarge);
  c.key = std::string("blocked requests would hold ") +
          std::to_string((own ? mine : waiting_bytes_) + charge) + " bytes, over the limit of " +
          std::to_string(own ? kMaxWaitingBytesPerConnection : kMaxWaitingBytes) +
          (own ? " per connection" : " for all connections");
  ready_.push_back(std::move(c));
  return true;
}

WaiterId KvState::park(ConnId conn, uint64_t tag, WaitKind kind, uint32_t timeout_ms,
                       std::vector<std::string> keys, std::size_t charge) {
  const WaiterId id = next_waiter_++;
  Waiter& w = waiters_[id];
  w.conn = conn;
  w.tag = tag;
  w.kind = kind;
  w.deadline = deadline_for(timeout_ms);
  w.keys = std::move(keys);
  w.charge = charge;
  waiting_bytes_ += charge;
  Session& s = sessions_[conn];
  s.waiters.insert(id);
  s.waiting_bytes += charge;
  if (w.deadline != kNoDeadline) deadlines_.emplace(w.deadline, id);
  return id;
}

void KvState::link(WaiterId id, Waiter& w, Index index, const std::string& name) {
  w.index = index;
  WaitList* list = nullptr;
  switch (index) {
    case Index::Keys:
      w.positions.reserve(w.keys.size());
      for (const std::string& k : w.keys) {
        WaitList& l = key_waiters_[k];
        w.positions.push_back(l.insert(l.end(), id));
      }
      w.linked = true;
      return;
    case Index::Key: list = &key_waiters_[name]; break;
    case Index::Pop: list = &pop_waiters_[name]; break;
    case Index::Barrier: list = &barriers_[name].arrived; break;
    case Index::WatchKey: list = &watch_keys_[name]; break;
    case Index::WatchPrefix:
      list = &watch_prefixes_[name];
      if (list->empty()) ++prefix_lengths_[name.size()];
      break;
  }
  w.pos = list->insert(list->end(), id);
  w.linked = true;
}

void KvState::unlink(WaiterId, Waiter& w) {
  if (!w.linked) return;
  w.linked = false;
  const std::string& name = w.keys[0];
  auto erase_from = [&](auto& map, const std::string& n, WaitList::iterator pos) {
    auto it = map.find(n);
    it->second.erase(pos);
    if (it->second.empty()) map.erase(it);
  };
  switch (w.index) {
    case Index::Keys:
      for (std::size_t i = 0; i < w.keys.size(); ++i) erase_from(key_waiters_, w.keys[i], w.positions[i]);
      w.positions.clear();
      break;
    case Index::Key: erase_from(key_waiters_, name, w.pos); break;
    case Index::Pop: erase_from(pop_waiters_, name, w.pos); break;
    case Index::Barrier:
      barriers_.at(name).arrived.erase(w.pos);
      barrier_idle(name);
      break;
    case Index::WatchKey: erase_from(watch_keys_, name, w.pos); break;
    case Index::WatchPrefix:
      erase_from(watch_prefixes_, name, w.pos);
      if (!watch_prefixes_.count(name)) {
        auto len = prefix_lengths_.find(name.size());
        if (--len->second == 0) prefix_lengths_.erase(len);
      }
      break;
  }
}

void KvState::drop(WaiterId id) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  Waiter& w = it->second;
  unlink(id, w);
  if (w.deadline != kNoDeadline) deadlines_.erase({w.deadline, id});
  if (auto s = sessions_.find(w.conn); s != sessions_.end()) {
    s->second.waiters.erase(id);
    s->second.waiting_bytes -= w.charge;
  }
  waiting_bytes_ -= w.charge;
  waiters_.erase(it);
}

void KvState::finish(WaiterId id, Completion c) {
  ready_.push_back(std::move(c));
  drop(id);
}

void KvState::timeout_waiter(WaiterId id) {
  const Waiter& w = waiters_.at(id);
  Completion c = make(w.conn, w.tag, w.kind, Status::Timeout);
  switch (w.kind) {
    case WaitKind::Wait:
    case WaitKind::MultiGet:
    case WaitKind::WaitOrQueue:
      for (const auto& k : w.keys)
        if (!present(k, w.kind)) c.values.push_back(k);
      break;
    case WaitKind::Barrier: {
      const Barrier& b = barriers_.at(w.keys[0]);
      c.arrived = static_cast<uint32_t>(b.arrived.size());
      c.world_size = b.world_size;
      break;
    }
    case WaitKind::Watch: c.revision = revision_; break;
    default: break;
  }
  finish(id, std::move(c));  // a barrier participant is withdrawn here
}

uint64_t KvState::next_deadline() const noexcept {
  return deadlines_.empty() ? kNoDeadline : deadlines_.begin()->first;
}

void KvState::expire(uint64_t now_ms) {
  while (!deadlines_.empty() && deadlines_.begin()->first <= now_ms)
    timeout_waiter(deadlines_.begin()->second);
}

bool KvState::take_ready(std::vector<Completion>* out) {
  out->clear();
  if (ready_.empty()) return false;
  out->swap(ready_);
  return true;
}

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
  if (history_.empty()) return nullptr;
  const uint64_t front = history_.front().revision;  // revisions in history are contiguous
  for (std::size_t i = after < front ? 0 : after - front + 1; i < history_.size(); ++i) {
    const HistoryEvent& ev = history_[i];
    if (prefix ? ev.key.compare(0, key.size(), key) == 0 && ev.key.size() >= key.size()
               : ev.key == key)
      return &ev;
  }
  return nullptr;
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
