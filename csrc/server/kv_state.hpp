// The store's data and its waiters; no sockets, no wire format. Every codec (native now, torch's
// TCPStore later) decodes requests into calls here and encodes the Completions this produces.
//
// Waiters (Redis blocked.c): a blocked request is a record in `waiters_`, linked into an index
// list (the key it waits for, the queue, the barrier, the watched key or prefix; a multi-key WAIT or
// MULTI_GET into the list of each of its keys, counting the missing ones) through stored list
// iterators, into its session's waiter set, and into the deadline index. Unlinking is O(1) per
// list, so closing a connection costs O(its own waiters' keys), and a change to a key costs
// O(waiters of that key). What blocked requests hold is charged per session and in total
// (kMaxWaitingBytes*). A finished waiter becomes a Completion on the ready list, which the server
// drains after each command.
#pragma once

#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "wire/protocol.hpp"

namespace elasticstore {

using ConnId = uint64_t;
using WaiterId = uint64_t;
inline constexpr uint64_t kNoDeadline = ~uint64_t{0};
// Bookkeeping charged to each history event besides its key and value bytes.
inline constexpr std::size_t kHistoryEventOverheadBytes = 64;
// A watch scans at most this many events after its revision; with no match there, it looks its
// key (or the keys under its prefix) up in the history's index of revisions by key: a watcher
// that returns after a timeout to watch from an old revision (a ring watcher polling a liveness
// key while the run's heartbeats fill the history) no longer costs a scan of the whole history,
// and one that catches up event by event still finds each next event at once.
inline constexpr uint64_t kWatchScanEvents = 1024;
// Bookkeeping charged to a blocked request against kMaxWaitingBytes*, besides twice its key bytes
// (its copy and the index's): per request, and per key (list node, iterator, index entry).
inline constexpr std::size_t kWaiterOverheadBytes = 256;
inline constexpr std::size_t kWaiterKeyOverheadBytes = 160;

// Wait is torch's WAIT (on both codecs): a name counts as present while a key of that name exists
// or a queue of that name holds items, as in torch's stores (its client sends WAIT on the queue
// before a blocking QUEUE_POP). Get and MultiGet wait for keys alone: a queue holds no value.
enum class WaitKind : uint8_t { Get, Wait, MultiGet, QueuePop, Barrier, Watch };

// A finished blocking request in codec-neutral form. It holds no copy of a stored value: GET and
// MULTI_GET name their keys and the codec reads the values from KvState when it encodes the reply
// (after the command, before anything can delete them: see Server's drain), once it knows the
// reply fits; a WATCH shares the history event's value. One write can wake any number of waiters
// without copying its value per waiter.
struct Completion {
  ConnId conn = 0;
  uint64_t tag = 0;  // the codec's handle on the request (native: request id)
  WaitKind kind = WaitKind::Get;
  Status status = Status::Ok;
  // QUEUE_POP: the popped item; WAIT/MULTI_GET TIMEOUT: the missing keys; MULTI_GET OK: the keys
  // whose values make the reply.
  std::vector<std::string> values;
  std::string key;                   // GET OK: the key; WATCH: the changed key; ERROR: the message
  std::shared_ptr<const std::string> value;  // WATCH OK: the event's value
  EventKind event = EventKind::Set;  // WATCH
  // GET: mod_revision; WATCH: the event's revision, the current one (TIMEOUT) or the oldest held
  // (COMPACTED); BARRIER: the generation.
  uint64_t revision = 0;
  uint32_t arrived = 0, world_size = 0;  // BARRIER TIMEOUT
};

// The limits KvState and the codecs enforce; each defaults to its constant in protocol.hpp and is
// set from ServerConfig. Key, value and count limits may only be lowered (frames stay bounded by
// kMaxFrameBytes).
struct StoreLimits {
  std::size_t max_key_bytes = kMaxKeyBytes;
  std::size_t max_value_bytes = kMaxValueBytes;
  std::size_t max_keys_per_request = kMaxKeysPerRequest;
  std::size_t max_waiters_per_connection = kDefaultMaxWaitersPerConnection;
  std::size_t max_stored_keys = kDefaultMaxStoredKeys;    // keys plus queued items
  std::size_t max_stored_bytes = kDefaultMaxStoredBytes;  // their key/name and value bytes
  // A released barrier name with nobody waiting keeps its next generation this long after its
  // last arrival, then is forgotten (a later arrival starts again at generation 0).
  uint32_t barrier_idle_ms = kBarrierIdleMs;
};

struct Entry {
  std::string value;
  uint64_t mod_revision = 0;
  ConnId owner = 0;  // session the key is bound to (ephemeral); 0: none
};

struct CasResult {
  bool swapped = false;
  bool exists = false;
  std::string current;
};

struct HistoryEvent {
  EventKind kind;
  std::string key;
  std::shared_ptr<const std::string> value;  // shared with the WATCH completions it wakes
  uint64_t revision;
};

class KvState {
 public:
  using Clock = uint64_t (*)();  // monotonic milliseconds
  explicit KvState(Clock clock = nullptr, StoreLimits limits = {});
  const StoreLimits& limits() const noexcept { return limits_; }

  // ---- quota (checked by the codecs before a write; nothing changes on refusal) ----
  // Whether storing `value_bytes` under `key` (created or replaced) stays within max_stored_*;
  // else *why says which limit.
  bool fits(std::string_view key, std::size_t value_bytes, std::string* why) const;
  // The same for several keys (MULTI_SET), counted as if each were stored alone, and for a queued
  // item.
  bool fits_all(const std::vector<std::pair<std::string_view, std::string_view>>& kvs,
                std::string* why) const;
  bool fits_queue_item(std::string_view queue, std::size_t value_bytes, std::string* why) const;
  std::size_t stored_entries() const noexcept { return stored_entries_; }
  std::size_t stored_bytes() const noexcept { return stored_bytes_; }

  // ---- sessions ----
  void open_session(ConnId conn);
  // Drops the session's waiters silently, then deletes the keys still bound to it.
  void close_session(ConnId conn);
  // Drops the session's waiters without a reply (torch's CANCEL_WAIT).
  void cancel_waiters(ConnId conn);

  // ---- plain operations (sizes are the codec's to check) ----
  uint64_t set(ConnId conn, std::string_view key, std::string_view value, bool ephemeral);
  const Entry* find(std::string_view key) const;
  Status add(std::string_view key, int64_t delta, int64_t* out);
  CasResult compare_set(ConnId conn, std::string_view key, std::string_view expected,
                        std::string_view desired, bool ephemeral);
  // Whether every name is present as WAIT counts it: a key, or a queue holding items.
  bool check(const std::vector<std::string_view>& keys) const;
  bool erase(std::string_view key);
  std::size_t num_keys() const noexcept { return keys_.size(); }
  // The keys under `prefix`, sorted; pointers into the store (valid until the next change), so a
  // reply can be totalled before anything is copied.
  std::vector<const std::string*> list_keys(std::string_view prefix) const;
  Status append(std::string_view key, std::string_view value, uint64_t* revision);
  int64_t queue_push(std::string_view queue, std::string_view value);
  int64_t queue_len(std::string_view queue) const;
  // Pops the oldest item into *out; false when the queue is empty. Never blocks.
  bool queue_try_pop(std::string_view queue, std::string* out);

  // ---- blocking operations: the answer is a Completion on the ready list, at once or later ----
  void get(ConnId conn, uint64_t tag, std::string_view key, uint32_t timeout_ms);
  void wait(ConnId conn, uint64_t tag, const std::vector<std::string_view>& keys,
            uint32_t timeout_ms, WaitKind kind = WaitKind::Wait);
  void queue_pop(ConnId conn, uint64_t tag, std::string_view queue, uint32_t timeout_ms);
  void barrier(ConnId conn, uint64_t tag, std::string_view key, uint32_t world_size,
               uint32_t timeout_ms);
  void watch(ConnId conn, uint64_t tag, std::string_view key, bool is_prefix,
             uint64_t after_revision, uint32_t timeout_ms);

  // ---- deadlines and completions ----
  uint64_t next_deadline() const noexcept;
  void expire(uint64_t now_ms);
  // Moves the ready completions into *out (cleared first); false when there were none.
  bool take_ready(std::vector<Completion>* out);

  // ---- stats ----
  uint64_t revision() const noexcept { return revision_; }
  std::size_t waiter_count() const noexcept { return waiters_.size(); }
  std::size_t waiting_bytes() const noexcept { return waiting_bytes_; }  // charged, all sessions
  std::size_t queue_count() const noexcept { return queues_.size(); }
  std::size_t history_size() const noexcept { return history_.size(); }
  // Barrier names the server holds: in progress, or released once (their generation is kept).
  std::size_t barrier_count() const noexcept { return barriers_.size() + barrier_generations_.size(); }
  // Forgets the idle barrier names whose last arrival is barrier_idle_ms old (also done on every
  // barrier request); the server calls it between polls.
  void expire_idle_barriers();

 private:
  using WaitList = std::list<WaiterId>;
  // Keys: a multi-key WAIT/MULTI_GET, linked under every one of its keys (present or not) and
  // counting the missing ones, so a create or delete costs O(waiters of that key).
  enum class Index : uint8_t { Key, Keys, Pop, Barrier, WatchKey, WatchPrefix };
  struct Waiter {
    ConnId conn = 0;
    uint64_t tag = 0;
    WaitKind kind = WaitKind::Get;
    Index index = Index::Key;
    uint64_t deadline = kNoDeadline;
    std::vector<std::string> keys;  // the key(s), queue, barrier or watched key/prefix
    std::size_t missing = 0;        // Keys: how many of `keys` are absent
    uint64_t after = 0;             // WATCH
    WaitList::iterator pos;
    std::vector<WaitList::iterator> positions;  // Keys: one per entry of `keys`
    std::size_t charge = 0;                     // bytes counted in waiting_bytes_
    bool linked = false;
  };
  // A barrier generation in progress. Once nobody waits, the entry is erased; a released name
  // keeps only its next generation in barrier_generations_, which reuse needs.
  struct Barrier {
    uint64_t generation = 0;
    uint32_t world_size = 0;
    WaitList arrived;
  };
  struct Session {
    std::unordered_set<WaiterId> waiters;
    std::unordered_set<std::string> owned;
    std::size_t waiting_bytes = 0;
  };

  uint64_t deadline_for(uint32_t timeout_ms) const;
  // What parking a request on these keys costs, and whether that is refused: then a TOO_LARGE
  // completion is queued and nothing else changes.
  static std::size_t charge_for(std::size_t nkeys, std::size_t key_bytes) noexcept;
  bool refuse_park(ConnId conn, uint64_t tag, WaitKind kind, std::size_t charge);
  WaiterId park(ConnId conn, uint64_t tag, WaitKind kind, uint32_t timeout_ms,
                std::vector<std::string> keys, std::size_t charge);
  void link(WaiterId id, Waiter& w, Index index, const std::string& name);
  void unlink(WaiterId id, Waiter& w);
  void finish(WaiterId id, Completion c);  // completes and destroys the waiter
  void drop(WaiterId id);                  // destroys the waiter without a reply
  void timeout_waiter(WaiterId id);
  Completion make(ConnId conn, uint64_t tag, WaitKind kind, Status status) const;
  bool present(std::string_view key, WaitKind kind) const;
  Completion keys_ready(const Waiter& w) const;  // the OK completion of a Keys waiter
  // A key or queue name became present or absent for the Keys waiters on it; `affects` says
  // whether a key or a queue changed: Wait waiters count either, Get and MultiGet waiters keys only.
  enum class Affects : uint8_t { Key, Queue };
  void presence_changed(const std::string& name, bool now_present, Affects affects);
  void queue_filled(const std::string& queue);   // a queue went from empty to non-empty
  void queue_drained(const std::string& queue);  // ... and back
  void barrier_idle(const std::string& name);    // erase the entry once nobody waits

  void bind(Entry& e, std::string_view key, ConnId conn, bool ephemeral);
  uint64_t record(EventKind kind, std::string_view key, std::string_view value);
  void key_created(const std::string& key);
  void key_deleted(const std::string& key);
  void notify_watchers(const HistoryEvent& ev);
  Entry& upsert(std::string_view key, bool* created);
  const HistoryEvent* first_match(const std::string& key, bool prefix, uint64_t after) const;

  bool within(std::size_t entries, std::size_t bytes, std::string* why) const;
  void charge_value(std::size_t old_bytes, std::size_t new_bytes) noexcept {
    stored_bytes_ = stored_bytes_ - old_bytes + new_bytes;
  }

  Clock clock_;
  StoreLimits limits_;
  std::size_t stored_entries_ = 0;  // keys plus queued items
  std::size_t stored_bytes_ = 0;    // their key/name and value bytes
  uint64_t revision_ = 0;
  std::unordered_map<std::string, Entry> keys_;
  std::deque<HistoryEvent> history_;
  // The revisions of each key's events in history_, oldest first (ordered: prefix lookups).
  std::map<std::string, std::deque<uint64_t>, std::less<>> history_by_key_;
  std::size_t history_bytes_ = 0;
  uint64_t compacted_through_ = 0;  // revision of the newest event dropped from history
  std::unordered_map<std::string, std::deque<std::string>> queues_;
  std::unordered_map<std::string, Barrier> barriers_;            // generations in progress
  // Idle names released before: their next generation and last arrival, oldest arrival first in
  // idle_barriers_ (at most kMaxIdleBarrierNames: past it the oldest is forgotten).
  struct IdleBarrier {
    uint64_t generation = 0;
    uint64_t last_ms = 0;
    std::list<std::string>::iterator pos;
  };
  void barrier_released(const std::string& name, uint64_t generation);
  std::unordered_map<std::string, IdleBarrier> barrier_generations_;
  std::list<std::string> idle_barriers_;
  std::unordered_map<ConnId, Session> sessions_;

  std::unordered_map<WaiterId, Waiter> waiters_;
  std::size_t waiting_bytes_ = 0;
  WaiterId next_waiter_ = 1;
  std::unordered_map<std::string, WaitList> key_waiters_;
  std::unordered_map<std::string, WaitList> pop_waiters_;
  std::unordered_map<std::string, WaitList> watch_keys_;
  // Watched prefixes, plus how many prefixes of each length exist: a change probes only the
  // lengths in use instead of scanning watchers.
  std::map<std::string, WaitList, std::less<>> watch_prefixes_;
  std::map<std::size_t, std::size_t> prefix_lengths_;
  std::set<std::pair<uint64_t, WaiterId>> deadlines_;
  std::vector<Completion> ready_;
};

}  // namespace elasticstore
