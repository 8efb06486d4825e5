// The physical limit for a store round trip: a raw TCP ping-pong on loopback.
//
// One client connection sends a small message and waits for the echo, N times; the latency of
// each round trip is measured with CLOCK_MONOTONIC. Output: one JSON object on stdout.
//
//   tcp_pingpong [bench] [--iters N] [--warmup W] [--size S] [--max-seconds T]
//       forks an echo server process, runs the client against it, prints JSON
//   tcp_pingpong server [--host 127.0.0.1] [--port 0]
//       prints "tcp_pingpong server listening on H:P", echoes until killed: one epoll thread
//       for every connection, as the store servers (the many-client rows of the report)
//   tcp_pingpong client --port P [--host 127.0.0.1] [--iters N] [--warmup W] [--size S]
//       runs the client against a running server, prints JSON
//
// In bench mode both ends set TCP_NODELAY and use blocking sockets (a thread per connection on
// the server): the least work a request/reply protocol over TCP can do.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Options {
  std::string mode = "bench";
  std::string host = "127.0.0.1";
  int port = 0;
  long iters = 20000;
  long warmup = 2000;
  long size = 32;
  double max_seconds = 10.0;
};

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "tcp_pingpong: %s: %s\n", what, std::strerror(errno));
  std::exit(1);
}

int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

void set_nodelay(int fd) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) die("TCP_NODELAY");
}

bool read_full(int fd, char* buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::recv(fd, buf + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r == 0) {
      return false;
    } else if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

bool write_full(int fd, const char* buf, size_t n) {
  size_t sent = 0;
  while (sent < n) {
    ssize_t w = ::send(fd, buf + sent, n - sent, MSG_NOSIGNAL);
    if (w > 0) {
      sent += static_cast<size_t>(w);
    } else if (w < 0 && errno != EINTR) {
      return false;
    }
  }
  return true;
}

sockaddr_in make_addr(const std::string& host, int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    std::fprintf(stderr, "tcp_pingpong: not a numeric IPv4 address: %s\n", host.c_str());
    std::exit(2);
  }
  return addr;
}

int listen_on(const std::string& host, int port, int* bound_port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) die("socket");
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr = make_addr(host, port);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) die("bind");
  if (::listen(fd, SOMAXCONN) != 0) die("listen");
  socklen_t len = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) die("getsockname");
  *bound_port = ntohs(addr.sin_port);
  return fd;
}

// Echoes whatever arrives, until the peer closes.
void echo_connection(int fd) {
  set_nodelay(fd);
  std::vector<char> buf(1 << 16);
  for (;;) {
    ssize_t r = ::recv(fd, buf.data(), buf.size(), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    if (!write_full(fd, buf.data(), static_cast<size_t>(r))) break;
  }
  ::close(fd);
}

[[noreturn]] void serve(int listen_fd) {
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      die("accept");
    }
    std::thread(echo_connection, fd).detach();
  }
}

// Echoes on every connection from one epoll thread (level-triggered; a short write, which a
// 32-byte echo never meets, drops the rest: this is a benchmark's echo, not a general server).
[[noreturn]] void serve_epoll(int listen_fd) {
  const int ep = ::epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) die("epoll_create1");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = listen_fd;
  if (::epoll_ctl(ep, EPOLL_CTL_ADD, listen_fd, &ev) != 0) die("epoll_ctl");
  constexpr int kMaxEvents = 256;
  std::vector<epoll_event> events(kMaxEvents);
  std::vector<char> buf(1 << 16);
  for (;;) {
    const int n = ::epoll_wait(ep, events.data(), kMaxEvents, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      die("epoll_wait");
    }
    for (int i = 0; i < n; ++i) {
      const int fd = events[static_cast<size_t>(i)].data.fd;
      if (fd == listen_fd) {
        for (;;) {
          const int c = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
          if (c < 0) break;  // EAGAIN (or a transient error): back to epoll
          set_nodelay(c);
          epoll_event cev{};
          cev.events = EPOLLIN;
          cev.data.fd = c;
          if (::epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev) != 0) ::close(c);
        }
        continue;
      }
      const ssize_t r = ::recv(fd, buf.data(), buf.size(), 0);
      if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (r <= 0 || ::send(fd, buf.data(), static_cast<size_t>(r), MSG_NOSIGNAL) != r) {
        ::close(fd);  // also leaves the epoll set
      }
    }
  }
}

int run_client(const Options& o) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) die("socket");
  sockaddr_in addr = make_addr(o.host, o.port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) die("connect");
  set_nodelay(fd);

  std::vector<char> out(static_cast<size_t>(o.size), 'x');
  std::vector<char> in(static_cast<size_t>(o.size));
  auto round_trip = [&]() {
    if (!write_full(fd, out.data(), out.size()) || !read_full(fd, in.data(), in.size())) {
      die("round trip");
    }
  };
  for (long i = 0; i < o.warmup; ++i) round_trip();

  std::vector<int64_t> samples;
  samples.reserve(static_cast<size_t>(o.iters));
  const int64_t deadline = now_ns() + static_cast<int64_t>(o.max_seconds * 1e9);
  for (long i = 0; i < o.iters; ++i) {
    const int64_t t0 = now_ns();
    round_trip();
    const int64_t t1 = now_ns();
    samples.push_back(t1 - t0);
    if (t1 > deadline) break;
  }
  ::close(fd);
  if (samples.empty()) return 1;

  std::sort(samples.begin(), samples.end());
  auto pct = [&](double p) {
    size_t idx = static_cast<size_t>(p * static_cast<double>(samples.size() - 1) + 0.5);
    return samples[std::min(idx, samples.size() - 1)];
  };
  long double sum = 0;
  for (int64_t s : samples) sum += s;
  std::printf(
      "{\"iters\": %zu, \"size\": %ld, \"p50_ns\": %lld, \"p99_ns\": %lld, \"mean_ns\": %.1f, "
      "\"min_ns\": %lld, \"max_ns\": %lld}\n",
      samples.size(), o.size, static_cast<long long>(pct(0.50)), static_cast<long long>(pct(0.99)),
      static_cast<double>(sum / samples.size()), static_cast<long long>(samples.front()),
      static_cast<long long>(samples.back()));
  return 0;
}

Options parse(int argc, char** argv) {
  Options o;
  int i = 1;
  if (i < argc && argv[i][0] != '-') o.mode = argv[i++];
  for (; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "tcp_pingpong: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--host") o.host = next();
    else if (a == "--port") o.port = std::atoi(next());
    else if (a == "--iters") o.iters = std::atol(next());
    else if (a == "--warmup") o.warmup = std::atol(next());
    else if (a == "--size") o.size = std::atol(next());
    else if (a == "--max-seconds") o.max_seconds = std::atof(next());
    else {
      std::fprintf(stderr, "tcp_pingpong: unknown argument %s\n", a.c_str());
      std::exit(2);
    }
  }
  if (o.iters < 1 || o.warmup < 0 || o.size < 1 || o.size > (1 << 16) || o.max_seconds <= 0) {
    std::fprintf(stderr, "tcp_pingpong: bad arguments\n");
    std::exit(2);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  if (o.mode == "server") {
    int port = 0;
    int lfd = listen_on(o.host, o.port, &port);
    std::printf("tcp_pingpong server listening on %s:%d\n", o.host.c_str(), port);
    std::fflush(stdout);
    int flags = ::fcntl(lfd, F_GETFL);
    if (flags < 0 || ::fcntl(lfd, F_SETFL, flags | O_NONBLOCK) != 0) die("fcntl");
    serve_epoll(lfd);
  }
  if (o.mode == "client") {
    if (o.port == 0) {
      std::fprintf(stderr, "tcp_pingpong: client needs --port\n");
      return 2;
    }
    return run_client(o);
  }
  if (o.mode != "bench") {
    std::fprintf(stderr, "tcp_pingpong: unknown mode %s (bench, server, client)\n", o.mode.c_str());
    return 2;
  }
  // bench: the echo server runs in its own process, as the store servers do.
  int port = 0;
  int lfd = listen_on(o.host, 0, &port);
  pid_t child = ::fork();
  if (child < 0) die("fork");
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    serve(lfd);
  }
  ::close(lfd);
  o.port = port;
  int rc = run_client(o);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  return rc;
}
