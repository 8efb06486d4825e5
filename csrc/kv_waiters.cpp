// KvState's waiters (see kv_state.hpp): parking, linking by key and by connection, waking on
// changes, expiry by deadline, and the blocking operations built on them. The data operations are
// in kv_state.cpp.
#include "kv_state.hpp"

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
    c.values.push_back(ev.value);
    c.revision = ev.revision;
    finish(id, std::move(c));
  }
}

void KvState::key_created(const std::string& key) {
  auto it = key_waiters_.find(key);
  if (it == key_waiters_.end()) return;
  const std::vector<WaiterId> ids(it->second.begin(), it->second.end());
  for (WaiterId id : ids) {
    Waiter& w = waiters_.at(id);
    if (w.kind == WaitKind::Get) {
      const Entry* e = find(key);
      Completion c = make(w.conn, w.tag, w.kind, Status::Ok);
      c.values.push_back(e->value);
      c.revision = e->mod_revision;
      finish(id, std::move(c));
    } else {
      advance(id, w);
    }
  }
}

void KvState::queue_filled(const std::string& queue) {
  auto it = key_waiters_.find(queue);
  if (it == key_waiters_.end()) return;
  const std::vector<WaiterId> ids(it->second.begin(), it->second.end());
  for (WaiterId id : ids) {
    Waiter& w = waiters_.at(id);
    if (w.kind == WaitKind::WaitOrQueue) advance(id, w);
  }
}

// A multi-key waiter is linked under one missing key at a time; when that key appears it moves to
// the next missing one, so each key of the request is examined O(1) times amortized.
bool KvState::advance(WaiterId id, Waiter& w) {
  unlink(id, w);
  const std::size_t n = w.keys.size();
  for (std::size_t step = 1; step <= n; ++step) {
    const std::size_t i = (w.cursor + step) % n;  // the wrap re-checks keys deleted meanwhile
    if (!present(w.keys[i], w.kind)) {
      w.cursor = i;
      link(id, w, Index::Key, w.keys[i]);
      return false;
    }
  }
  Completion c = make(w.conn, w.tag, w.kind, Status::Ok);
  if (w.kind == WaitKind::MultiGet)
    for (const auto& k : w.keys) c.values.push_back(find(k)->value);
  finish(id, std::move(c));
  return true;
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

WaiterId KvState::park(ConnId conn, uint64_t tag, WaitKind kind, uint32_t timeout_ms,
                       std::vector<std::string> keys) {
  const WaiterId id = next_waiter_++;
  Waiter& w = waiters_[id];
  w.conn = conn;
  w.tag = tag;
  w.kind = kind;
  w.deadline = deadline_for(timeout_ms);
  w.keys = std::move(keys);
  sessions_[conn].waiters.insert(id);
  if (w.deadline != kNoDeadline) deadlines_.emplace(w.deadline, id);
  return id;
}

void KvState::link(WaiterId id, Waiter& w, Index index, const std::string& name) {
  w.index = index;
  WaitList* list = nullptr;
  switch (index) {
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
  const std::string& name = w.index == Index::Key ? w.keys[w.cursor] : w.keys[0];
  auto erase_from = [&](auto& map) {
    auto it = map.find(name);
    it->second.erase(w.pos);
    if (it->second.empty()) map.erase(it);
  };
  switch (w.index) {
    case Index::Key: erase_from(key_waiters_); break;
    case Index::Pop: erase_from(pop_waiters_); break;
    case Index::Barrier: barriers_.at(name).arrived.erase(w.pos); break;
    case Index::WatchKey: erase_from(watch_keys_); break;
    case Index::WatchPrefix:
      erase_from(watch_prefixes_);
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
  if (auto s = sessions_.find(w.conn); s != sessions_.end()) s->second.waiters.erase(id);
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
  if (const Entry* e = find(key)) {
    Completion c = make(conn, tag, WaitKind::Get, Status::Ok);
    c.values.push_back(e->value);
    c.revision = e->mod_revision;
    ready_.push_back(std::move(c));
  } else if (timeout_ms == 0) {
    ready_.push_back(make(conn, tag, WaitKind::Get, Status::Timeout));
  } else {
    const WaiterId id = park(conn, tag, WaitKind::Get, timeout_ms, {std::string(key)});
    Waiter& w = waiters_.at(id);
    link(id, w, Index::Key, w.keys[0]);
  }
}

void KvState::wait(ConnId conn, uint64_t tag, const std::vector<std::string_view>& keys,
                   uint32_t timeout_ms, WaitKind kind) {
  std::size_t missing = keys.size();
  for (std::size_t i = 0; i < keys.size(); ++i)
    if (!present(keys[i], kind) && missing == keys.size()) missing = i;
  if (missing == keys.size()) {
    Completion c = make(conn, tag, kind, Status::Ok);
    if (kind == WaitKind::MultiGet)
      for (auto k : keys) c.values.push_back(find(k)->value);
    ready_.push_back(std::move(c));
  } else if (timeout_ms == 0) {
    Completion c = make(conn, tag, kind, Status::Timeout);
    for (auto k : keys)
      if (!present(k, kind)) c.values.emplace_back(k);
    ready_.push_back(std::move(c));
  } else {
    const WaiterId id =
        park(conn, tag, kind, timeout_ms, std::vector<std::string>(keys.begin(), keys.end()));
    Waiter& w = waiters_.at(id);
    w.cursor = missing;
    link(id, w, Index::Key, w.keys[missing]);
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
  } else {
    const WaiterId id = park(conn, tag, WaitKind::QueuePop, timeout_ms, {std::string(queue)});
    Waiter& w = waiters_.at(id);
    link(id, w, Index::Pop, w.keys[0]);
  }
}

void KvState::barrier(ConnId conn, uint64_t tag, std::string_view key, uint32_t world_size,
                      uint32_t timeout_ms) {
  auto fail = [&](std::string msg) {
    Completion c = make(conn, tag, WaitKind::Barrier, Status::Error);
    c.key = std::move(msg);
    ready_.push_back(std::move(c));
  };
  if (world_size == 0) return fail("barrier world_size must be at least 1");
  Barrier& b = barriers_[std::string(key)];
  if (!b.arrived.empty() && b.world_size != world_size)
    return fail("barrier world_size mismatch: " + std::to_string(world_size) + " given, " +
                std::to_string(b.world_size) + " in progress");
  b.world_size = world_size;
  if (b.arrived.size() + 1 >= world_size) {
    const uint64_t generation = b.generation++;
    const std::vector<WaiterId> ids(b.arrived.begin(), b.arrived.end());
    for (WaiterId id : ids) {
      const Waiter& w = waiters_.at(id);
      Completion c = make(w.conn, w.tag, w.kind, Status::Ok);
      c.revision = generation;
      finish(id, std::move(c));
    }
    Completion c = make(conn, tag, WaitKind::Barrier, Status::Ok);
    c.revision = generation;
    ready_.push_back(std::move(c));
  } else if (timeout_ms == 0) {
    Completion c = make(conn, tag, WaitKind::Barrier, Status::Timeout);
    c.arrived = static_cast<uint32_t>(b.arrived.size() + 1);
    c.world_size = world_size;
    ready_.push_back(std::move(c));
  } else {
    const WaiterId id = park(conn, tag, WaitKind::Barrier, timeout_ms, {std::string(key)});
    Waiter& w = waiters_.at(id);
    link(id, w, Index::Barrier, w.keys[0]);
  }
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
    c.values.push_back(ev->value);
    c.revision = ev->revision;
  } else if (timeout_ms == 0) {
    c.status = Status::Timeout;
    c.revision = revision_;
  } else {
    const WaiterId id = park(conn, tag, WaitKind::Watch, timeout_ms, {std::string(key)});
    Waiter& w = waiters_.at(id);
    w.after = after;
    link(id, w, is_prefix ? Index::WatchPrefix : Index::WatchKey, w.keys[0]);
    return;
  }
  ready_.push_back(std::move(c));
}

}  // namespace elasticstore
