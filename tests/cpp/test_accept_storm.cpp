// A connection storm at the server: more clients from one address than kMaxHalfOpenPerPeer have
// their handshake buffered before the server accepts any of them (the server listens, but its
// loop has not started: the kernel completes the connects into the listen backlog). Every one of
// them is answered; connections that send nothing are still held to the bound, the oldest closed.
// (tests/stores/test_connect_storm.py does the same through elasticstore-server; this one runs
// under ASan/UBSan with scripts/test-sanitizers.)
#include <sys/resource.h>

#include <thread>

#include "server_harness.hpp"

namespace {

constexpr std::size_t kPrompt = kMaxHalfOpenPerPeer + 76;
constexpr std::size_t kSilent = kMaxHalfOpenPerPeer + 76;

bool fd_room(std::size_t need) {
  rlimit lim{};
  return ::getrlimit(RLIMIT_NOFILE, &lim) == 0 && (lim.rlim_cur == RLIM_INFINITY || lim.rlim_cur >= need);
}

// Waits (bounded) until the server has accepted `n` connections in all.
bool accepted(const Server& srv, uint64_t n) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(kWaitMs);
  while (stat(srv, "connections_accepted") < n) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

}  // namespace

TEST(buffered_handshakes_are_served_and_silent_connections_still_bounded) {
  Server srv(quiet_config());  // raises the soft open-file limit to the hard one
  // This process holds both ends of every connection, plus a few.
  if (!fd_room(2 * (kPrompt + kSilent) + 64)) {
    std::fprintf(stderr, "skipped: the open-file limit is under %zu\n", 2 * (kPrompt + kSilent) + 64);
    return;
  }
  const std::string handshake = std::string(kNativePreamble, kPreambleBytes) + hello_frame();
  std::vector<std::unique_ptr<Sock>> prompt, silent;
  for (std::size_t i = 0; i < kPrompt; ++i) {
    prompt.push_back(std::make_unique<Sock>(srv.port()));
    CHECK(prompt.back()->connected());
    CHECK(prompt.back()->send(handshake));
  }
  for (std::size_t i = 0; i < kSilent; ++i) {
    silent.push_back(std::make_unique<Sock>(srv.port()));
    CHECK(silent.back()->connected());
  }
  srv.start();
  std::size_t answered = 0;
  for (auto& s : prompt) {
    const Reply r = s->recv();
    if (r.ok && r.status == 0) ++answered;
  }
  CHECK_EQ(answered, kPrompt);
  CHECK(accepted(srv, kPrompt + kSilent));
  CHECK(stat(srv, "connections_half_open") <= kMaxHalfOpenPerPeer);
  CHECK(stat(srv, "connections_shed_half_open") >= kSilent - kMaxHalfOpenPerPeer);
  for (std::size_t i = 0; i < 8; ++i) CHECK(ping_ok(*prompt[i * (kPrompt / 8)], 40 + i));  // still served
  srv.stop();
}
