// KvState's waiters (see kv_state.hpp): parking, linking by key and by connection, waking on
// changes, expiry by deadline. The blocking operations built on them are in kv_blocking.cpp, the
// data operations in kv_state.cpp.
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
  presence_changed(key, true, Affects::Key);
}

void KvState::key_deleted(const std::string& key) { presence_changed(key, false, Affects::Key); }

void KvState::queue_filled(const std::string& queue) {
  presence_changed(queue, true, Affects::Queue);
}
void KvState::queue_drained(const std::string& queue) {
  presence_changed(queue, false, Affects::Queue);
}

// A key's creation or deletion changes presence for Get and MultiGet waiters, and for Wait
// waiters unless a queue of that name holds items; a queue filling or draining changes it for
// Wait waiters alone, unless the key exists. Each Keys waiter is listed once per occurrence of
// the name in its request.
void KvState::presence_changed(const std::string& name, bool now_present, Affects affects) {
  auto it = key_waiters_.find(name);
  if (it == key_waiters_.end()) return;
  const bool other_holds =
      affects == Affects::Queue ? find(name) != nullptr : queue_len(name) > 0;  // for Wait
  std::vector<WaiterId> done;
  for (WaiterId id : it->second) {
    Waiter& w = waiters_.at(id);
    if (w.index != Index::Keys) continue;
    const bool or_queue = w.kind == WaitKind::Wait;
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
  // The clock counts whole milliseconds (truncated): "now" may be up to 1 ms past clock_(). One
  // more makes a timeout never end early: a wait of 50 ms lasts 50 to 51 ms.
  return timeout_ms == kNoTimeout ? kNoDeadline : clock_() + timeout_ms + 1;
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

}  // namespace elasticstore
