// The client's lifetime, one request/reply exchange and the mapping of error replies. Connecting
// and the handshake are in connect.cpp, the operations in ops.cpp and blocking_ops.cpp, the socket
// in transport.cpp.
#include "client/client.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <utility>

#include "client/ops.hpp"
#include "wire/auth.hpp"

namespace elasticstore {
using namespace client_detail;
namespace {

using std::chrono::milliseconds;

// The client waits for a blocking request's reply until the server timeout plus this slack.
constexpr milliseconds kMinSlack{2000};
constexpr std::size_t kReadChunk = 64 * 1024;

}  // namespace

namespace client_detail {

std::string lower_op(Op op) {
  std::string s = op_name(static_cast<uint8_t>(op));
  for (char& c : s) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return s;
}

uint32_t wire_timeout(Timeout t) {
  if (t.count() < 0) return kNoTimeout;
  if (static_cast<uint64_t>(t.count()) >= kNoTimeout) return kNoTimeout - 1;  // clamp (~49 days)
  return static_cast<uint32_t>(t.count());
}

void check_key(Op op, std::string_view key) {
  if (key.size() > kMaxKeyBytes) {
    throw StoreError(lower_op(op) + ": key of " + std::to_string(key.size()) +
                     " bytes exceeds the limit of " + std::to_string(kMaxKeyBytes) + " bytes");
  }
}

void check_value(Op op, std::string_view key, std::string_view value) {
  if (value.size() > kMaxValueBytes) {
    throw StoreError(lower_op(op) + " " + quote(key) + ": value of " +
                     std::to_string(value.size()) + " bytes exceeds the limit of " +
                     std::to_string(kMaxValueBytes) + " bytes");
  }
}

void check_keys(Op op, const std::vector<std::string>& keys) {
  if (keys.size() > kMaxKeysPerRequest) {
    throw StoreError(lower_op(op) + ": " + std::to_string(keys.size()) +
                     " keys exceed the limit of " + std::to_string(kMaxKeysPerRequest) +
                     " keys per request");
  }
  for (const auto& k : keys) check_key(op, k);
}

void read_keys(Reader& rd, std::vector<std::string>* out) {
  const uint32_t n = rd.count(kMaxKeysPerRequest, 4);
  out->reserve(n);
  for (uint32_t i = 0; i < n && rd.ok(); ++i) out->emplace_back(rd.bytes(kMaxReplyField));
}

}  // namespace client_detail

// ---- lifetime ---------------------------------------------------------------------------------

Client::Client(std::string host, uint16_t port, ClientOptions options)
    : host_(std::move(host)),
      port_(port),
      options_(std::move(options)),
      op_timeout_ms_(options_.op_timeout.count()),
      connect_timeout_ms_(options_.connect_timeout.count()) {
  if (host_.size() >= 2 && host_.front() == '[' && host_.back() == ']') {
    host_ = host_.substr(1, host_.size() - 2);  // "[::1]" -> "::1"
  }
  if (options_.client_name.size() > kMaxClientNameBytes) {
    throw StoreError("client name of " + std::to_string(options_.client_name.size()) +
                     " bytes exceeds the limit of " + std::to_string(kMaxClientNameBytes) +
                     " bytes");
  }
  rng_.seed(client_detail::random_seed());
  conn_ = std::make_unique<ClientTransport>(host_, port_, options_.interrupt_check,
                                            options_.interruptible, [this] {
    connected_ = false;
    session_id_ = 0;
  });
  std::lock_guard<std::timed_mutex> lock(mu_);
  connect_locked(options_.connect_timeout);
}

Client::~Client() = default;

bool Client::connected() const { return connected_.load(std::memory_order_relaxed); }

std::unique_ptr<Client> Client::clone() const {
  check_not_closed();
  ClientOptions options = options_;
  options.op_timeout = op_timeout();
  options.connect_timeout = connect_timeout();
  options.server_tag = server_tag_.load(std::memory_order_relaxed);
  return std::make_unique<Client>(host_, port_, std::move(options));
}

void Client::close() {
  conn_->signal_close();
  std::lock_guard<std::timed_mutex> lock(mu_);  // waits for a call in progress to notice
  close_fd_locked();
}

std::unique_lock<std::timed_mutex> Client::lock_call() {
  std::unique_lock<std::timed_mutex> lock(mu_, std::defer_lock);
  if (lock.try_lock()) return lock;
  const milliseconds poll = options_.interrupt_check ? milliseconds(kInterruptPollMs)
                                                     : milliseconds(1000);
  for (;;) {
    check_not_closed();
    if (lock.try_lock_for(poll)) return lock;
    if (options_.interrupt_check && options_.interrupt_check()) {
      throw InterruptedError(endpoint() + ": interrupted while waiting for another thread's " +
                             "call on this client");
    }
  }
}

Client::Call Client::start_call(Op op) {
  const auto start = Clock::now();
  std::unique_lock<std::timed_mutex> lock(mu_, std::try_to_lock);
  if (lock.owns_lock()) {
    call_start_ = start;  // one clock read for both
  } else {
    try {
      lock = lock_call();
    } catch (const NetworkError&) {
      call_stats::record(op, call_stats::Outcome::Network, Clock::now() - start);
      throw;
    } catch (...) {
      call_stats::record(op, call_stats::Outcome::Error, Clock::now() - start);
      throw;
    }
    call_start_ = Clock::now();
  }
  failure_ = call_stats::Outcome::Error;
  return Call(*this, op, start, std::move(lock));
}

Client::Call::Call(Client& client, Op op, Clock::time_point start,
                   std::unique_lock<std::timed_mutex> lock)
    : lock_(std::move(lock)),
      client_(client),
      op_(op),
      start_(start),
      exceptions_(std::uncaught_exceptions()) {}

Client::Call::~Call() {
  const auto outcome =
      std::uncaught_exceptions() > exceptions_ ? client_.failure_ : call_stats::Outcome::Ok;
  call_stats::record(op_, outcome, Clock::now() - start_);
}

void Client::check_not_closed() const { conn_->check_not_closed(); }

std::string Client::endpoint() const { return conn_->endpoint(); }

// Also resets connected_ and session_id_, through the transport's on_close.
void Client::close_fd_locked() { conn_->close_fd(); }

void Client::fail_protocol_locked(const std::string& what) {
  failure_ = call_stats::Outcome::Error;
  close_fd_locked();
  throw ProtocolError(endpoint() + ": protocol error: " + what + "; connection closed");
}

std::string CallSubject::describe() const {
  if (keys) return quote_list(*keys);
  if (has_key) return label + quote(key);
  return std::string();
}

void Client::rethrow_network_locked(const NetworkError& e, Op op) {
  failure_ = call_stats::Outcome::Network;
  const std::string s = subject_.describe();
  throw NetworkError(lower_op(op) + (s.empty() ? "" : " " + s) + ": " + e.what());
}

// ---- one exchange -----------------------------------------------------------------------------

Writer Client::begin_locked(Op op, Subject subject) {
  call_deadline_ = deadline_after(call_start_, op_timeout());
  subject_ = subject;
  try {
    ensure_connected_locked();
  } catch (const NetworkError& e) {
    rethrow_network_locked(e, op);
  }
  conn_->drop_consumed();
  if (wbuf_.capacity() > kKeepBufferBytes) std::string().swap(wbuf_);
  wbuf_.clear();
  Writer w(wbuf_);
  request_id_ = next_request_id_++;
  w.begin_frame(static_cast<uint8_t>(op), request_id_);
  return w;
}

Client::Reply Client::exchange_locked(Writer& w, Op op, uint32_t server_timeout_ms) {
  w.end_frame();
  if (wbuf_.size() - 4 > kMaxFrameBytes) {
    throw StoreError(lower_op(op) + ": the request of " + std::to_string(wbuf_.size()) +
                     " bytes exceeds the frame limit of " + std::to_string(kMaxFrameBytes) +
                     " bytes");
  }
  try {
    conn_->send_all(wbuf_.data(), wbuf_.size(), call_deadline_, op_name(static_cast<uint8_t>(op)));
    const auto sent_at = Clock::now();
    Clock::time_point deadline;
    if (server_timeout_ms == kNotBlocking) {
      deadline = call_deadline_;
    } else if (server_timeout_ms == kNoTimeout) {
      deadline = Clock::time_point::max();
    } else {
      const milliseconds t(server_timeout_ms);
      deadline = sent_at + t + std::max(kMinSlack, t / 10);
    }
    const Reply r = read_reply_locked(request_id_, deadline, op, server_timeout_ms, sent_at);
    if (r.status == static_cast<uint8_t>(Status::Timeout)) failure_ = call_stats::Outcome::Timeout;
    return r;
  } catch (const NetworkError& e) {
    rethrow_network_locked(e, op);
  }
}

Client::Reply Client::read_reply_locked(uint32_t request_id, Clock::time_point deadline, Op op,
                                        uint32_t server_timeout_ms, Clock::time_point sent_at) {
  const char* name = op_name(static_cast<uint8_t>(op));
  for (;;) {
    const std::string_view buf = conn_->buffered();
    FrameHeader h;
    const FrameParse st = peek_frame(buf.data(), buf.size(), kMaxReplyFrameBytes, &h);
    if (st == FrameParse::Ready) {
      if (h.request_id != request_id) {
        fail_protocol_locked("reply to request " + std::to_string(h.request_id) +
                             " while waiting for request " + std::to_string(request_id) + " (" +
                             std::string(name) + ")");
      }
      conn_->consume_later(h.total());
      return Reply{h.code, std::string_view(buf.data() + kFrameHeaderBytes, h.payload_len())};
    }
    if (st == FrameParse::TooLarge) {
      fail_protocol_locked(std::string("reply frame to ") + name + " too large");
    }
    if (st == FrameParse::Malformed) {
      fail_protocol_locked(std::string("malformed reply frame to ") + name);
    }
    std::size_t want = buf.size() + kReadChunk;
    if (buf.size() >= 4) {
      uint32_t body = 0;
      std::memcpy(&body, buf.data(), 4);
      want = std::max(want, 4 + static_cast<std::size_t>(body));
    }
    if (!conn_->receive(want, deadline, name)) {
      std::string what = std::string("no reply to ") + name + " within " +
                         fmt_seconds(seconds(Clock::now() - sent_at));
      if (server_timeout_ms != kNotBlocking && server_timeout_ms != kNoTimeout) {
        what += " (server timeout " + fmt_seconds(server_timeout_ms / 1000.0) + ")";
      } else {
        what += " (timeout)";
      }
      conn_->fail_network(what + "; connection closed");
    }
  }
}

void Client::fail_status_locked(const Reply& r, Op op, const std::string& subject) {
  switch (static_cast<Status>(r.status)) {
    case Status::Error:
    case Status::WrongType:
    case Status::TooLarge:
    case Status::Unauthenticated: {
      Reader rd(r.payload);
      const std::string msg(rd.bytes(kMaxReplyField));
      finish_locked(rd, op);
      throw StoreError(lower_op(op) + (subject.empty() ? "" : " " + subject) + ": " + msg);
    }
    default:
      fail_protocol_locked(std::string("unexpected status ") + status_name(r.status) +
                           " in the reply to " + op_name(static_cast<uint8_t>(op)));
  }
}

void Client::finish_locked(const Reader& rd, Op op) {
  if (!rd.done()) {
    fail_protocol_locked(std::string("malformed reply to ") + op_name(static_cast<uint8_t>(op)));
  }
}

}  // namespace elasticstore
