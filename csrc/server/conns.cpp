// The connections' side of the server: their events, frame and handshake timers, flushing,
// draining completed blocking requests into them, closing (which ends the session) and reaping.
#include <algorithm>
#include <new>
#include <string>

#include "server/server_impl.hpp"

namespace elasticstore {

// Completions name the keys whose values they return; the codec reads them while encoding. So
// that none of them is deleted in between, a session closed during the drain (a reply that did
// not fit) is ended only after the batch is encoded; its deletions wake the next batch.
void Server::Impl::drain_ready() {
  if (draining_) return;  // the outer drain picks up what a nested close queued
  draining_ = true;
  for (;;) {
    if (!kv_.take_ready(&batch_)) {
      if (ending_.empty()) break;
      std::vector<ConnId> ending;
      ending.swap(ending_);
      for (ConnId id : ending) kv_.close_session(id);
      continue;
    }
    for (const Completion& c : batch_) {
      auto it = conns_.find(c.conn);
      if (it == conns_.end()) continue;
      Connection* conn = it->second.get();
      if (conn->state() == ConnState::Closing) continue;
      if (!conn->deliver(c, kv_, buffer_room(), cfg_.max_buffered_bytes)) {
        mark_closing(conn);
        continue;
      }
      account(conn);
      if (!conn->dirty) {
        conn->dirty = true;
        dirty_.push_back(conn);
      }
    }
  }
  draining_ = false;
}

void Server::Impl::on_conn_event(EventLoop&, int fd, void* data, uint32_t mask) {
  auto* self = static_cast<Impl*>(data);
  if (static_cast<std::size_t>(fd) >= self->by_fd_.size()) return;
  Connection* c = self->by_fd_[static_cast<std::size_t>(fd)];
  if (c && c->state() != ConnState::Closing) self->on_conn(c, mask);
}

void Server::Impl::on_conn(Connection* c, uint32_t mask) {
  if ((mask & kWritable) && (c->events & kWritable)) flush(c);
  if ((mask & kReadable) && c->state() != ConnState::Closing) {
    try {
      c->on_readable(*this, scratch_.data(), scratch_.size());
    } catch (const std::bad_alloc&) {
      c->fail("out of memory while handling its request", false);
    }
    if (c->half_open && c->state() == ConnState::Serving) leave_half_open(c);
    if (c->state() != ConnState::Closing) {
      account(c);
      if (bytes_buffered_ > cfg_.max_buffered_bytes) over_budget(c);
    }
    if (c->state() != ConnState::Closing) {
      arm_frame_timer(c);
      publish();  // before the reply leaves, so a client that got it sees fresh stats()
      flush(c);  // the replies to everything this read completed, in one write
    }
  }
  if (c->state() == ConnState::Closing) mark_closing(c);
}

// A request that started must finish within kFrameTimeoutMs; the clock restarts whenever a
// request completes, so a busy pipelining client is never cut off.
void Server::Impl::arm_frame_timer(Connection* c) {
  if (!c->has_partial_request()) {
    if (c->frame_timer) loop_->cancel_timer(c->frame_timer);
    c->frame_timer = 0;
  } else if (!c->frame_timer || c->progressed()) {
    if (c->frame_timer) loop_->cancel_timer(c->frame_timer);
    const ConnId id = c->id();
    c->frame_timer = loop_->add_timer(cfg_.frame_timeout_ms, [this, id] { frame_timeout(id); });
  }
}

void Server::Impl::frame_timeout(ConnId id) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  Connection* c = it->second.get();
  c->frame_timer = 0;
  c->fail("request not finished within " + std::to_string(cfg_.frame_timeout_ms) + " ms", true);
  mark_closing(c);
}

void Server::Impl::handshake_timeout(ConnId id) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  Connection* c = it->second.get();
  c->handshake_timer = 0;
  if (c->state() != ConnState::AwaitingPreamble && c->state() != ConnState::Handshaking) return;
  c->fail("handshake not finished within " + std::to_string(cfg_.handshake_timeout_ms) + " ms", true);
  mark_closing(c);
}

void Server::Impl::over_budget(Connection* c) {
  c->fail("dropped to keep the server's buffers within their budget of " +
              std::to_string(cfg_.max_buffered_bytes) + " bytes across connections (" +
              std::to_string(c->buffered_bytes()) + " of " + std::to_string(bytes_buffered_) +
              " are this connection's)",
          false);
}

// Sends what the kernel takes; when that ends a pause, handles the requests it held back (which
// may pause it again). Reading is masked while paused, writing is watched while output is left.
void Server::Impl::flush(Connection* c) {
  for (;;) {
    if (c->state() == ConnState::Closing) return;
    if (!c->flush()) return mark_closing(c);
    if (c->paused() || !c->input_held()) break;
    if (!c->resume(*this)) return mark_closing(c);
    arm_frame_timer(c);
  }
  const uint32_t want = (c->paused() ? 0u : kReadable) | (c->wants_write() ? kWritable : 0u);
  if (want != c->events) {
    loop_->modify(c->fd(), want);
    c->events = want;
  }
  account(c);
}

// Logs why, ends the session at once (its ephemeral keys go, waking watchers elsewhere), and
// queues the object for reaping before the next poll, so no fd is reused within a batch.
void Server::Impl::mark_closing(Connection* c) {
  if (c->queued_close) return;
  c->queued_close = true;
  const bool quiet = c->close_reason() == "peer closed";
  if (c->bad_input()) ++closed_bad_input_;
  if (c->peer_lost()) {  // gone without FIN or RST: worth a warning, its session keys go now
    ++closed_peer_lost_;
    log(LogLevel::Warning, "closing connection %s: %s; %s", c->peer().c_str(),
        c->close_reason().c_str(), keepalive_note_.c_str());
  } else {
    log(c->bad_input() ? LogLevel::Warning : quiet ? LogLevel::Debug : LogLevel::Info,
        "closing connection %s: %s", c->peer().c_str(), c->close_reason().c_str());
  }
  leave_half_open(c);
  loop_->remove(c->fd());
  if (c->frame_timer) loop_->cancel_timer(c->frame_timer);
  if (c->handshake_timer) loop_->cancel_timer(c->handshake_timer);
  c->frame_timer = c->handshake_timer = 0;
  account(c);
  closing_.push_back(c);
  if (draining_) {  // see drain_ready(): ended once the batch being encoded is done
    ending_.push_back(c->id());
    return;
  }
  kv_.close_session(c->id());
  drain_ready();
}

void Server::Impl::before_sleep() {
  reap();
  kv_.expire_idle_barriers();
  arm_waiter_timer();
  publish();
  for (std::size_t i = 0; i < dirty_.size(); ++i) {  // flushing may close and append
    dirty_[i]->dirty = false;
    flush(dirty_[i]);
  }
  dirty_.clear();
  reap();
}

void Server::Impl::reap() noexcept {
  for (Connection* c : closing_) {
    if (c->dirty) dirty_.erase(std::remove(dirty_.begin(), dirty_.end(), c), dirty_.end());
    by_fd_[static_cast<std::size_t>(c->fd())] = nullptr;
    bytes_buffered_ -= c->accounted;
    if (auto p = per_peer_.find(c->peer_ip); p != per_peer_.end() && --p->second == 0) per_peer_.erase(p);
    conns_.erase(c->id());
  }
  closing_.clear();
}

// One loop timer tracks the earliest waiter deadline; KvState keeps the ordered deadlines.
void Server::Impl::arm_waiter_timer() {
  const uint64_t next = kv_.next_deadline();
  if (next == waiter_deadline_) return;
  if (waiter_timer_) loop_->cancel_timer(waiter_timer_);
  waiter_timer_ = 0;
  waiter_deadline_ = next;
  if (next == kNoDeadline) return;
  const uint64_t now = EventLoop::now_ms();
  waiter_timer_ = loop_->add_timer(next > now ? next - now : 0, [this] {
    waiter_timer_ = 0;
    waiter_deadline_ = kNoDeadline;
    kv_.expire(EventLoop::now_ms());
    drain_ready();
  });
}

}  // namespace elasticstore
