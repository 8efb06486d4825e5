// libFuzzer target: a connection's start, through the real Connection state machine over a
// socketpair: the preamble sniff that picks a codec ('E' native, 0x00 torch's), the native HELLO
// and torch's VALIDATE, then whatever follows. Checks: nothing is stored while the connection is
// not Serving; a refused start closes with a reason; the session ends without leftover waiters.
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "fuzz_common.hpp"
#include "server/connection.hpp"

using namespace elasticstore;

namespace {

class Host final : public ConnectionHost {
 public:
  // With a token, HELLO must be followed by a valid AUTH (the fuzzer cannot forge one): the
  // connection must never reach Serving, so nothing may be stored.
  Host(KvState& kv, bool with_token)
      : kv_(kv), auth_{with_token ? "fuzz-token" : "", PeerAllowList(true, {})} {}
  KvState& kv() noexcept override { return kv_; }
  ServerAuth& auth() noexcept override { return auth_; }
  void drain_ready() override {
    while (kv_.take_ready(&batch_))
      for (const Completion& c : batch_)
        if (conn && c.conn == conn->id()) conn->deliver(c, kv_, kMaxBufferedBytes, kMaxBufferedBytes);
  }
  void count_request() noexcept override {}
  StatsList stats_snapshot() const override { return {}; }
  Connection* conn = nullptr;

 private:
  KvState& kv_;
  ServerAuth auth_;
  std::vector<Completion> batch_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  if (size < 1 || size > 64 * 1024) return 0;
  const std::size_t chunk = 1 + (data[0] & 0x7f) % 32;
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0) return 0;
  StoreLimits lim;
  lim.max_stored_keys = 64;
  lim.max_stored_bytes = 64 * 1024;
  KvState kv([] { return uint64_t{0}; }, lim);
  const bool with_token = (data[0] & 0x80) != 0;
  Host host(kv, with_token);
  std::vector<char> scratch(16 * 1024);
  {
    Connection conn(sv[0], 1, "fuzz");
    host.conn = &conn;
    kv.open_session(1);
    bool open = true;
    for (std::size_t off = 1; off < size && open; off += chunk) {
      const std::size_t n = std::min(chunk, size - off);
      if (::write(sv[1], data + off, n) != static_cast<ssize_t>(n)) break;
      open = conn.on_readable(host, scratch.data(), scratch.size());
      if (conn.state() == ConnState::AwaitingPreamble || conn.state() == ConnState::Handshaking)
        FUZZ_ASSERT(kv.num_keys() == 0 && kv.queue_count() == 0);
      char sink[4096];
      while (::read(sv[1], sink, sizeof sink) > 0) {
      }
      conn.flush();
    }
    // A start that is neither the native preamble nor torch's VALIDATE never stores anything.
    static const uint8_t kValidate[5] = {0x00, 0xce, 0xf7, 0x85, 0x3c};
    const bool native = size >= 5 && std::memcmp(data + 1, kNativePreamble, 4) == 0;
    const bool torch = size >= 6 && std::memcmp(data + 1, kValidate, 5) == 0;
    if (!native && !torch) FUZZ_ASSERT(kv.num_keys() == 0 && kv.queue_count() == 0);
    if (with_token && native) FUZZ_ASSERT(kv.num_keys() == 0 && kv.queue_count() == 0);
    if (!open) FUZZ_ASSERT(conn.state() == ConnState::Closing && !conn.close_reason().empty());
    host.conn = nullptr;
    kv.close_session(1);
    FUZZ_ASSERT(kv.waiter_count() == 0);
  }  // the Connection closes sv[0]
  ::close(sv[1]);
  return 0;
}
