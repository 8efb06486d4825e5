#include "server/kv_state.hpp"

#include <algorithm>
#include <charconv>
#include <chrono>

namespace elasticstore {
namespace {
uint64_t steady_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}
// Counters are decimal ASCII: an optional '-' and digits, nothing else, within int64.
bool parse_int64(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, *out);
  return ec == std::errc() && p == end;
}
}  // namespace

KvState::KvState(Clock clock, StoreLimits limits)
    : clock_(clock ? clock : &steady_ms), limits_(limits) {}

// ---- quota -------------------------------------------------------------------------------------

bool KvState::within(std::size_t entries, std::size_t bytes, std::string* why) const {
  if (entries > limits_.max_stored_keys) {
    *why = "store full: " + std::to_string(entries) + " keys and queued items, over the limit of " +
           std::to_string(limits_.max_stored_keys) + " (max_stored_keys)";
    return false;
  }
  if (bytes > limits_.max_stored_bytes) {
    *why = "store full: " + std::to_string(bytes) + " bytes stored, over the limit of " +
           std::to_string(limits_.max_stored_bytes) + " (max_stored_bytes)";
    return false;
  }
  return true;
}

bool KvState::fits(std::string_view key, std::size_t value_bytes, std::string* why) const {
  const Entry* e = find(key);
  if (e) {
    const std::size_t old = e->value.size();
    return value_bytes <= old || within(stored_entries_, stored_bytes_ + value_bytes - old, why);
  }
  return within(stored_entries_ + 1, stored_bytes_ + key.size() + value_bytes, why);
}

bool KvState::fits_all(const std::vector<std::pair<std::string_view, std::string_view>>& kvs,
                       std::string* why) const {
  std::size_t entries = stored_entries_, bytes = stored_bytes_;
  for (const auto& [k, v] : kvs) {
    if (const Entry* e = find(k)) {
      if (v.size() > e->value.size()) bytes += v.size() - e->value.size();
    } else {
      ++entries;
      bytes += k.size() + v.size();
    }
  }
  return within(entries, bytes, why);
}

bool KvState::fits_queue_item(std::string_view queue, std::size_t value_bytes, std::string* why) const {
  return within(stored_entries_ + 1, stored_bytes_ + queue.size() + value_bytes, why);
}

// ---- sessions ----------------------------------------------------------------------------------

void KvState::open_session(ConnId conn) { sessions_.try_emplace(conn); }

void KvState::cancel_waiters(ConnId conn) {
  auto it = sessions_.find(conn);
  if (it == sessions_.end()) return;
  const std::vector<WaiterId> ids(it->second.waiters.begin(), it->second.waiters.end());
  for (WaiterId id : ids) drop(id);
}

void KvState::close_session(ConnId conn) {
  cancel_waiters(conn);
  auto it = sessions_.find(conn);
  if (it == sessions_.end()) return;
  const std::unordered_set<std::string> owned = std::move(it->second.owned);
  sessions_.erase(it);
  for (const std::string& key : owned) erase(key);  // DELETE events wake watchers
}

// ---- plain operations --------------------------------------------------------------------------

Entry& KvState::upsert(std::string_view key, bool* created) {
  auto [it, inserted] = keys_.try_emplace(std::string(key));
  *created = inserted;
  return it->second;
}

const Entry* KvState::find(std::string_view key) const {
  auto it = keys_.find(std::string(key));
  return it == keys_.end() ? nullptr : &it->second;
}

void KvState::bind(Entry& e, std::string_view key, ConnId conn, bool ephemeral) {
  const ConnId owner = ephemeral ? conn : 0;
  if (e.owner != 0 && e.owner != owner) {
    auto s = sessions_.find(e.owner);
    if (s != sessions_.end()) s->second.owned.erase(std::string(key));
  }
  e.owner = owner;
  if (ephemeral) sessions_[conn].owned.emplace(key);
}

uint64_t KvState::set(ConnId conn, std::string_view key, std::string_view value, bool ephemeral) {
  bool created = false;
  Entry& e = upsert(key, &created);
  if (created) {
    ++stored_entries_;
    stored_bytes_ += key.size();
  }
  charge_value(e.value.size(), value.size());
  e.value.assign(value);
  bind(e, key, conn, ephemeral);
  const uint64_t rev = e.mod_revision = record(EventKind::Set, key, value);
  if (created) key_created(std::string(key));
  return rev;
}

Status KvState::add(std::string_view key, int64_t delta, int64_t* out) {
  int64_t cur = 0;
  if (const Entry* e = find(key); e && !parse_int64(e->value, &cur)) return Status::WrongType;
  if (__builtin_add_overflow(cur, delta, out)) return Status::WrongType;
  bool created = false;
  Entry& e = upsert(key, &created);
  std::string text = std::to_string(*out);
  if (created) {
    ++stored_entries_;
    stored_bytes_ += key.size();
  }
  charge_value(e.value.size(), text.size());
  e.value = std::move(text);
  e.mod_revision = record(EventKind::Set, key, e.value);
  if (created) key_created(std::string(key));
  return Status::Ok;
}

CasResult KvState::compare_set(ConnId conn, std::string_view key, std::string_view expected,
                               std::string_view desired, bool ephemeral) {
  CasResult r;
  const Entry* e = find(key);
  if (e ? e->value == expected : expected.empty()) {
    set(conn, key, desired, ephemeral);
    r.swapped = r.exists = true;
    r.current.assign(desired);
  } else if (e) {
    r.exists = true;
    r.current = e->value;
  }
  return r;
}

bool KvState::check(const std::vector<std::string_view>& keys) const {
  for (auto k : keys)
    if (!present(k, WaitKind::Wait)) return false;
  return true;
}

bool KvState::present(std::string_view key, WaitKind kind) const {
  if (find(key)) return true;
  return kind == WaitKind::Wait && queue_len(key) > 0;
}

bool KvState::queue_try_pop(std::string_view queue, std::string* out) {
  auto it = queues_.find(std::string(queue));
  if (it == queues_.end() || it->second.empty()) return false;
  *out = std::move(it->second.front());
  it->second.pop_front();
  --stored_entries_;
  stored_bytes_ -= queue.size() + out->size();
  if (it->second.empty()) {
    queues_.erase(it);
    queue_drained(std::string(queue));
  }
  return true;
}

bool KvState::erase(std::string_view key) {
  auto it = keys_.find(std::string(key));
  if (it == keys_.end()) return false;
  if (it->second.owner != 0) {
    auto s = sessions_.find(it->second.owner);
    if (s != sessions_.end()) s->second.owned.erase(it->first);
  }
  const std::string name = it->first;
  --stored_entries_;
  stored_bytes_ -= name.size() + it->second.value.size();
  keys_.erase(it);
  record(EventKind::Delete, name, {});
  key_deleted(name);
  return true;
}

// Sorted on demand: LIST_KEYS is rare, and a hash map keeps every hot-path lookup O(1) without
// maintaining a second ordered index on each set.
std::vector<const std::string*> KvState::list_keys(std::string_view prefix) const {
  std::vector<const std::string*> out;
  for (const auto& kv : keys_)
    if (kv.first.compare(0, prefix.size(), prefix) == 0 && kv.first.size() >= prefix.size())
      out.push_back(&kv.first);
  std::sort(out.begin(), out.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
  return out;
}

Status KvState::append(std::string_view key, std::string_view value, uint64_t* revision) {
  if (const Entry* e = find(key); e && e->value.size() + value.size() > limits_.max_value_bytes)
    return Status::TooLarge;
  bool created = false;
  Entry& e = upsert(key, &created);
  if (created) {
    ++stored_entries_;
    stored_bytes_ += key.size();
  }
  stored_bytes_ += value.size();
  e.value.append(value);
  *revision = e.mod_revision = record(EventKind::Set, key, e.value);
  if (created) key_created(std::string(key));
  return Status::Ok;
}

int64_t KvState::queue_push(std::string_view queue, std::string_view value) {
  auto pw = pop_waiters_.find(std::string(queue));
  if (pw != pop_waiters_.end() && !pw->second.empty()) {
    const WaiterId oldest = pw->second.front();
    const Waiter& w = waiters_.at(oldest);
    Completion c = make(w.conn, w.tag, w.kind, Status::Ok);
    c.values.emplace_back(value);
    finish(oldest, std::move(c));
    return queue_len(queue);
  }
  const std::string name(queue);
  auto& q = queues_[name];
  q.emplace_back(value);
  ++stored_entries_;
  stored_bytes_ += name.size() + value.size();
  const auto len = static_cast<int64_t>(q.size());
  if (len == 1) queue_filled(name);
  return len;
}

int64_t KvState::queue_len(std::string_view queue) const {
  auto it = queues_.find(std::string(queue));
  return it == queues_.end() ? 0 : static_cast<int64_t>(it->second.size());
}

// ---- history (record() also wakes watchers: kv_waiters.cpp) ------------------------------------

uint64_t KvState::record(EventKind kind, std::string_view key, std::string_view value) {
  history_.push_back(HistoryEvent{kind, std::string(key), std::make_shared<const std::string>(value),
                                  ++revision_});
  auto slot = history_by_key_.find(key);
  if (slot == history_by_key_.end())
    slot = history_by_key_.emplace(std::string(key), std::deque<uint64_t>{}).first;
  slot->second.push_back(revision_);
  history_bytes_ += key.size() + value.size() + kHistoryEventOverheadBytes;
  while (history_.size() > 1 &&
         (history_.size() > kWatchHistoryEvents || history_bytes_ > kWatchHistoryBytes)) {
    const HistoryEvent& old = history_.front();
    history_bytes_ -= old.key.size() + old.value->size() + kHistoryEventOverheadBytes;
    compacted_through_ = old.revision;
    auto it = history_by_key_.find(old.key);  // its oldest revision is this event's
    it->second.pop_front();
    if (it->second.empty()) history_by_key_.erase(it);
    history_.pop_front();
  }
  notify_watchers(history_.back());
  return revision_;
}

}  // namespace elasticstore
