// The client's connection: connecting (with the reconnect budget of a call in progress), the HELLO
// and AUTH handshake, and reconnecting before a call when the connection was lost.
#include <algorithm>
#include <cstring>
#include <exception>
#include <utility>

#include "client/client.hpp"
#include "client/ops.hpp"
#include "wire/auth.hpp"

namespace elasticstore {
using namespace client_detail;
namespace {

using std::chrono::milliseconds;

// The shorter of two timeouts, negative meaning none.
Timeout min_timeout(Timeout a, Timeout b) {
  if (a.count() < 0) return b;
  if (b.count() < 0) return a;
  return std::min(a, b);
}

}  // namespace

// ---- connecting -------------------------------------------------------------------------------

void Client::connect_locked(Timeout timeout) {
  using call_stats::Outcome;
  const auto start = Clock::now();
  try {
    conn_->connect(timeout, [this](Clock::time_point deadline) { handshake_locked(deadline); });
  } catch (const NetworkError&) {
    call_stats::record(call_stats::kConnectSlot, Outcome::Network, Clock::now() - start);
    throw;
  } catch (...) {
    call_stats::record(call_stats::kConnectSlot, Outcome::Error, Clock::now() - start);
    throw;
  }
  call_stats::record(call_stats::kConnectSlot, Outcome::Ok, Clock::now() - start);
  check_same_server_locked();
}

// A reconnect that reached another instance of the server (restarted at the same address, or
// another server there now) is refused: its keys, watches and session-bound keys are not the
// ones this client knew, and going on there would be silently wrong. Not retried (outside the
// connect loop); every later call refuses it again.
void Client::check_same_server_locked() {
  const uint64_t tag = session_id_.load(std::memory_order_relaxed) >> kSessionCounterBits;
  uint64_t expected = server_tag_.load(std::memory_order_relaxed);
  if (expected == 0) expected = options_.server_tag;
  if (expected == 0 || tag == 0 || tag == expected) {
    if (expected == 0) server_tag_.store(tag, std::memory_order_relaxed);
    else server_tag_.store(expected, std::memory_order_relaxed);
    return;
  }
  close_fd_locked();
  throw NetworkError(endpoint() + ": another server instance answers there than the one this "
                     "client connected to (it restarted, or another took its address): the "
                     "keys and sessions this client knew are gone; refusing it (a new client "
                     "may use it)");
}

void Client::handshake_locked(Clock::time_point deadline) {
  // A server that accepts but never answers must not stall the retries forever; a connection
  // made in the last attempt's window still gets a short window for the handshake.
  const auto now = Clock::now();
  const Timeout op = op_timeout();
  if (op.count() >= 0) deadline = std::min(deadline, now + op);
  deadline = std::max(deadline, now + kLastAttemptWindow);
  std::string client_nonce;
  if (!options_.token.empty()) {
    client_nonce = make_nonce();
    if (client_nonce.empty()) {
      close_fd_locked();
      throw AuthenticationError("connecting to " + endpoint() + ": RAND_bytes failed (no nonce)");
    }
  }
  wbuf_.clear();
  wbuf_.append(kNativePreamble, kPreambleBytes);
  Writer w(wbuf_);
  const uint32_t id = next_request_id_++;
  w.begin_frame(static_cast<uint8_t>(Op::Hello), id);
  w.u32(kProtocolVersion);
  w.bytes(options_.client_name);
  w.bytes(client_nonce);
  w.end_frame();
  conn_->send_all(wbuf_.data(), wbuf_.size(), deadline, op_name(static_cast<uint8_t>(Op::Hello)));
  const Reply r = read_reply_locked(id, deadline, Op::Hello, kNotBlocking, Clock::now());
  if (r.status != static_cast<uint8_t>(Status::Ok)) {
    Reader rd(r.payload);
    const std::string msg(rd.bytes(kMaxReplyField));
    if (r.status == static_cast<uint8_t>(Status::Unauthenticated)) fail_auth_locked("the server refused: " + msg);
    close_fd_locked();
    throw StoreError("connecting to " + endpoint() + ": the server refused the session (" +
                     status_name(r.status) + "): " + msg);
  }
  Reader rd(r.payload);
  const uint32_t version = rd.u32();
  const uint64_t session = rd.u64();
  const std::string server_nonce(rd.bytes(kAuthNonceBytes));
  if (version != kProtocolVersion) {
    close_fd_locked();
    throw StoreError("connecting to " + endpoint() + ": the server speaks protocol version " +
                     std::to_string(version) + ", this client " +
                     std::to_string(kProtocolVersion));
  }
  finish_locked(rd, Op::Hello);
  if (options_.token.empty() && !server_nonce.empty())
    fail_auth_locked("the server requires a token and this client has none");
  if (!options_.token.empty()) {
    if (server_nonce.empty())
      fail_auth_locked("this client has a token but the server does not authenticate (it has "
                       "no token); refusing it, since it cannot prove it holds the token");
    if (server_nonce.size() != kAuthNonceBytes) fail_protocol_locked("HELLO: bad server nonce");
    authenticate_locked(deadline, client_nonce, server_nonce);
  }
  session_id_ = session;
  connected_ = true;
}

// AUTH: proves the token for this pair of nonces, then checks the server's proof (constant time).
void Client::authenticate_locked(Clock::time_point deadline, const std::string& client_nonce,
                                 std::string_view server_nonce) {
  conn_->drop_consumed();  // HELLO's reply
  wbuf_.clear();
  Writer w(wbuf_);
  const uint32_t id = next_request_id_++;
  w.begin_frame(static_cast<uint8_t>(Op::Auth), id);
  w.bytes(auth_mac(options_.token, AuthRole::Client, client_nonce, server_nonce));
  w.end_frame();
  conn_->send_all(wbuf_.data(), wbuf_.size(), deadline, op_name(static_cast<uint8_t>(Op::Auth)));
  const Reply r = read_reply_locked(id, deadline, Op::Auth, kNotBlocking, Clock::now());
  Reader rd(r.payload);
  if (r.status != static_cast<uint8_t>(Status::Ok)) {
    const std::string msg(rd.bytes(kMaxReplyField));
    fail_auth_locked(std::string("the server refused (") + status_name(r.status) + "): " + msg);
  }
  const std::string_view server_mac = rd.bytes(kAuthMacBytes);
  finish_locked(rd, Op::Auth);
  if (!mac_equal(server_mac, auth_mac(options_.token, AuthRole::Server, client_nonce, server_nonce)))
    fail_auth_locked("the server could not prove it holds the token (wrong token on the server, "
                     "or not the server you meant)");
}

void Client::fail_auth_locked(const std::string& why) {
  close_fd_locked();
  throw AuthenticationError("connecting to " + endpoint() + ": authentication failed: " + why +
                            "; connection closed");
}

void Client::ensure_connected_locked() {
  check_not_closed();
  // fork() child: the socket is the parent's too. Drop it unused and connect anew.
  if (conn_->inherited()) conn_->drop_inherited();
  // Nothing of a new request was sent yet, so reconnecting here is always safe.
  if (conn_->is_open() && !conn_->idle_alive()) close_fd_locked();
  if (!conn_->is_open()) {
    Timeout budget = min_timeout(options_.reconnect_timeout, connect_timeout());
    if (call_deadline_ != Clock::time_point::max()) {
      const auto left = std::chrono::ceil<milliseconds>(call_deadline_ - Clock::now());
      budget = min_timeout(budget, std::max(left, milliseconds(0)));
    }
    connect_locked(budget);
  }
}

}  // namespace elasticstore
