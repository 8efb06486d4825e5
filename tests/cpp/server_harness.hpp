// Test harness for the server's end-to-end tests: a blocking loopback socket with poll()
// deadlines and hand-encoded native frames.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "check.hpp"
#include "server/server.hpp"
#include "wire/protocol.hpp"


using namespace elasticstore;
using Clock = std::chrono::steady_clock;

inline constexpr int kWaitMs = 5000;  // bound on every wait in these tests

inline ServerConfig quiet_config() {
  ServerConfig c;
  c.log_level = LogLevel::Off;
  return c;
}

struct Reply {
  bool ok = false;  // a whole frame arrived
  uint8_t status = 0;
  uint32_t id = 0;
  std::string payload;
  Reader reader() const { return Reader(payload); }
};

class Sock {
 public:
  explicit Sock(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  }
  ~Sock() { close(); }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  bool connected() const { return connected_; }
  void shutdown_write() { ::shutdown(fd_, SHUT_WR); }
  bool send(const std::string& s) {
    std::size_t off = 0;
    while (off < s.size()) {
      const ssize_t n = ::send(fd_, s.data() + off, s.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<std::size_t>(n);
    }
    return true;
  }
  // Reads until one whole frame is buffered or the deadline passes.
  Reply recv(int timeout_ms = kWaitMs) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    Reply r;
    for (;;) {
      FrameHeader h;
      if (peek_frame(buf_.data(), buf_.size(), kMaxReplyBytes + 64, &h) == FrameParse::Ready) {
        r.ok = true;
        r.status = h.code;
        r.id = h.request_id;
        r.payload = buf_.substr(kFrameHeaderBytes, h.payload_len());
        buf_.erase(0, h.total());
        return r;
      }
      if (!fill(deadline)) return r;
    }
  }
  // True when the server closed the connection before the deadline.
  bool closed_by_peer(int timeout_ms = kWaitMs) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (fill(deadline)) {
    }
    return eof_;
  }
  // Reads exactly n raw bytes (torch's protocol has no frames); empty when the deadline passes.
  std::string read_bytes(std::size_t n, int timeout_ms = kWaitMs) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (buf_.size() < n)
      if (!fill(deadline)) return {};
    std::string out = buf_.substr(0, n);
    buf_.erase(0, n);
    return out;
  }
  bool readable_within(int ms) {
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, ms) > 0;
  }

 private:
  bool fill(Clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0 || eof_) return false;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
    char tmp[65536];
    const ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
    if (n <= 0) {
      eof_ = true;
      return false;
    }
    buf_.append(tmp, static_cast<std::size_t>(n));
    return true;
  }
  int fd_ = -1;
  bool connected_ = false;
  bool eof_ = false;
  std::string buf_;
};

inline std::string frame(Op op, uint32_t id, const std::function<void(Writer&)>& body = {}) {
  std::string out;
  Writer w(out);
  w.begin_frame(static_cast<uint8_t>(op), id);
  if (body) body(w);
  w.end_frame();
  return out;
}
inline std::string hello_frame(uint32_t id = 1) {
  return frame(Op::Hello, id, [](Writer& w) {
    w.u32(kProtocolVersion);
    w.bytes("test");
    w.bytes("");  // no client nonce: no token
  });
}
inline std::string set_frame(uint32_t id, const std::string& k, const std::string& v, uint8_t flags = 0) {
  return frame(Op::Set, id, [&](Writer& w) {
    w.bytes(k);
    w.bytes(v);
    w.u8(flags);
  });
}
inline std::string get_frame(uint32_t id, const std::string& k, uint32_t timeout) {
  return frame(Op::Get, id, [&](Writer& w) {
    w.bytes(k);
    w.u32(timeout);
  });
}
inline std::string ping_frame(uint32_t id, uint64_t nonce) {
  return frame(Op::Ping, id, [&](Writer& w) { w.u64(nonce); });
}

// A connection that has sent the preamble and completed HELLO.
inline std::unique_ptr<Sock> greeted(uint16_t port) {
  auto s = std::make_unique<Sock>(port);
  s->send(std::string(kNativePreamble, kPreambleBytes) + hello_frame());
  Reply r = s->recv();
  CHECK(r.ok);
  CHECK_EQ(r.status, uint8_t{0});
  return s;
}

inline bool ping_ok(Sock& s, uint64_t nonce) {
  if (!s.send(ping_frame(77, nonce))) return false;
  Reply r = s.recv();
  return r.ok && r.status == 0 && r.id == 77 && r.reader().u64() == nonce;
}

inline uint64_t stat(const Server& srv, const std::string& name) {
  for (const auto& [k, v] : srv.stats())
    if (k == name) return v;
  return ~0ull;
}

inline int count_fds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d)) ++n;
    ::closedir(d);
  }
  return n;
}
