/* A connection storm from one process: N clients connect at once (non-blocking connects from
 * several loopback source addresses), do their protocol's handshake, then meet in one store
 * barrier (ADD a counter; the last arrival SETs a key; everyone WAITs on it). One epoll thread
 * drives every client, so 16,384 clients cost one process, not 16,384.
 *
 *   storm client --port P --clients N --proto torch|native|echo [--host 127.0.0.1]
 *                [--sources 8] [--first-source 2] [--batch 64] [--retry-ms 1000]
 *                [--timeout-s 60] [--key storm] [--hold 0|1]
 *       runs the storm against a server, prints one JSON object on stdout; --hold 1: then keeps
 *       every connection open (idle) until stdin closes (the server's memory per connection)
 *   storm echo [--host 127.0.0.1] [--port 0] [--backlog 65535]
 *       the floor: prints "storm echo listening on H:P", then echoes every connection's bytes
 *       (one epoll thread; accepts until EAGAIN on each wake-up)
 *
 * Protocols, byte for byte what their clients send:
 *   torch   torch's TCPStore client: VALIDATE (u8 0, u32 magic) and PING (u8 13, u32 nonce;
 *           reply: the nonce), ADD (u8 4, u64 len, key, i64 1; reply i64), the last one SET
 *           (u8 1, key, value; no reply), WAIT (u8 6, u64 1, key; reply u8 0). Keys carry torch's
 *           "/" prefix.
 *   native  elasticstore's: preamble "ESTO", HELLO (version 2, no nonce), ADD, SET, WAIT frames
 *           (docs/protocol.md); every reply is a frame with status OK.
 *   echo    32 bytes out, the same 32 back (no barrier): the least a server can do per client.
 *
 * A connect refused or reset, or a connection closed or reset before its handshake reply, is
 * counted and retried after retry-ms (+-50% jitter), as a client library would; a connection
 * lost after its handshake is counted as failed (its ADD may have counted) and not retried.
 * The process raises its own open-file limit to N + kFdHeadroom (as root, the hard one too).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { kMaxClients = 1 << 20, kFdHeadroom = 256, kBufBytes = 256, kEchoBytes = 32,
       kMaxEvents = 1024, kMaxSources = 200 };
static const uint32_t kValidationMagic = 0x3C85F7CEu;

enum Proto { TORCH, NATIVE, ECHO };
enum State { IDLE, CONNECTING, HANDSHAKE, ADDING, WAITING, DONE, FAILED };

struct Client {
  int fd;
  uint8_t state;
  uint8_t replies_left; /* replies still expected in this state */
  uint16_t out_len, out_off, in_len;
  uint32_t nonce;
  int64_t done_ns, connected_ns;
  char out[kBufBytes];
  char in[kBufBytes];
};

struct Retry {
  int64_t due_ns;
  int id;
};

static struct Client* C;
static struct Retry* heap;
static int heap_n;
static int hold, n_clients, n_sources = 8, first_source = 2, batch = 64, proto = TORCH;
static long retry_ms = 1000;
static double timeout_s = 60;
static const char* host = "127.0.0.1";
static int port;
static const char* key = "storm";
static struct sockaddr_in server_addr;
static int ep;
static long refused, reset_connect, reset_handshake, eof_handshake, connect_timeouts, retries,
    failed, done, connected_total, other_errors;
static int64_t t0, last_connected_ns, last_handshake_ns, last_added_ns, first_done_ns;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void die(const char* what) {
  fprintf(stderr, "storm: %s: %s\n", what, strerror(errno));
  exit(1);
}

static void raise_nofile(rlim_t want, rlim_t need) {
  struct rlimit lim;
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) die("getrlimit");
  if (lim.rlim_cur >= want) return;
  struct rlimit up = lim;
  if (up.rlim_max < want) up.rlim_max = want; /* root with CAP_SYS_RESOURCE */
  up.rlim_cur = want;
  if (setrlimit(RLIMIT_NOFILE, &up) == 0) return;
  lim.rlim_cur = lim.rlim_max; /* without it: the hard limit, when that is enough */
  if (lim.rlim_max < need || setrlimit(RLIMIT_NOFILE, &lim) != 0) {
    fprintf(stderr, "storm: cannot raise the open-file limit to %lu: %s\n", (unsigned long)want,
            strerror(errno));
    exit(1);
  }
}

/* ---- retry heap (min on due time) ---- */
static void heap_push(int64_t due, int id) {
  int i = heap_n++;
  while (i > 0) {
    int p = (i - 1) / 2;
    if (heap[p].due_ns <= due) break;
    heap[i] = heap[p];
    i = p;
  }
  heap[i].due_ns = due;
  heap[i].id = id;
}

static struct Retry heap_pop(void) {
  struct Retry top = heap[0], last = heap[--heap_n];
  int i = 0;
  for (;;) {
    int c = 2 * i + 1;
    if (c >= heap_n) break;
    if (c + 1 < heap_n && heap[c + 1].due_ns < heap[c].due_ns) c++;
    if (heap[c].due_ns >= last.due_ns) break;
    heap[i] = heap[c];
    i = c;
  }
  if (heap_n > 0) heap[i] = last;
  return top;
}

/* ---- encoding ---- */
static void put(struct Client* c, const void* p, size_t n) {
  memcpy(c->out + c->out_len, p, n);
  c->out_len = (uint16_t)(c->out_len + n);
}
static void put_u8(struct Client* c, uint8_t v) { put(c, &v, 1); }
static void put_u32(struct Client* c, uint32_t v) { put(c, &v, 4); }
static void put_u64(struct Client* c, uint64_t v) { put(c, &v, 8); }
static void torch_key(struct Client* c, const char* suffix) {
  char k[96];
  int n = snprintf(k, sizeof k, "/%s/%s", key, suffix);
  put_u64(c, (uint64_t)n);
  put(c, k, (size_t)n);
}
static void native_bytes(struct Client* c, const char* s, uint32_t n) {
  put_u32(c, n);
  put(c, s, n);
}
static void native_key(struct Client* c, const char* suffix) {
  char k[96];
  int n = snprintf(k, sizeof k, "%s/%s", key, suffix);
  native_bytes(c, k, (uint32_t)n);
}
/* A native frame: u32 body_len | u8 op | u32 request_id | payload (written by fill). */
static size_t frame_begin(struct Client* c, uint8_t op, uint32_t rid) {
  size_t at = c->out_len;
  put_u32(c, 0);
  put_u8(c, op);
  put_u32(c, rid);
  return at;
}
static void frame_end(struct Client* c, size_t at) {
  uint32_t body = (uint32_t)(c->out_len - at - 4);
  memcpy(c->out + at, &body, 4);
}

enum { kOpHello = 1, kOpSet = 2, kOpAdd = 5, kOpWait = 7 };
enum { kTsSet = 1, kTsAdd = 4, kTsWait = 6, kTsPing = 13 };

static void queue_handshake(struct Client* c, int id) {
  c->out_len = c->out_off = 0;
  c->in_len = 0;
  if (proto == ECHO) {
    memset(c->out, 'e', kEchoBytes);
    c->out_len = kEchoBytes;
  } else if (proto == TORCH) {
    put_u8(c, 0);
    put_u32(c, kValidationMagic);
    c->nonce = (uint32_t)id * 2654435761u + 1;
    put_u8(c, kTsPing);
    put_u32(c, c->nonce);
  } else {
    put(c, "ESTO", 4);
    size_t f = frame_begin(c, kOpHello, 1);
    put_u32(c, 2);
    native_bytes(c, "storm", 5);
    native_bytes(c, "", 0);
    frame_end(c, f);
  }
  c->replies_left = 1;
}

static void queue_add(struct Client* c) {
  c->out_len = c->out_off = 0;
  if (proto == TORCH) {
    put_u8(c, kTsAdd);
    torch_key(c, "count");
    put_u64(c, 1);
  } else {
    size_t f = frame_begin(c, kOpAdd, 2);
    native_key(c, "count");
    put_u64(c, 1);
    frame_end(c, f);
  }
  c->replies_left = 1;
}

static void queue_wait(struct Client* c, int last) {
  c->out_len = c->out_off = 0;
  c->replies_left = 1;
  if (proto == TORCH) {
    if (last) {
      put_u8(c, kTsSet);
      torch_key(c, "done");
      put_u64(c, 1);
      put_u8(c, '1');
    }
    put_u8(c, kTsWait);
    put_u64(c, 1);
    torch_key(c, "done");
  } else {
    if (last) {
      size_t f = frame_begin(c, kOpSet, 3);
      native_key(c, "done");
      native_bytes(c, "1", 1);
      put_u8(c, 0);
      frame_end(c, f);
      c->replies_left = 2;
    }
    size_t f = frame_begin(c, kOpWait, 4);
    put_u32(c, 1);
    native_key(c, "done");
    put_u32(c, 0xFFFFFFFFu);
    frame_end(c, f);
  }
}

/* ---- connections ---- */
static void close_client(struct Client* c) {
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
}

static void schedule_retry(int id) {
  struct Client* c = &C[id];
  close_client(c);
  c->state = IDLE;
  ++retries;
  double jitter = 0.5 + (double)rand() / RAND_MAX;
  heap_push(now_ns() + (int64_t)(retry_ms * jitter * 1e6), id);
}

static void fail_client(int id, const char* why) {
  struct Client* c = &C[id];
  if (failed < 5) fprintf(stderr, "storm: client %d failed after its handshake: %s\n", id, why);
  close_client(c);
  c->state = FAILED;
  ++failed;
}

static void lost(int id, int err, int eof);
static int send_out(struct Client* c, int id);

/* The connect completed: send the handshake. */
static void connected(int id) {
  struct Client* c = &C[id];
  c->state = HANDSHAKE;
  c->connected_ns = now_ns();
  if (c->connected_ns > last_connected_ns) last_connected_ns = c->connected_ns;
  ++connected_total;
  queue_handshake(c, id);
  if (send_out(c, id) != 0) lost(id, errno, 0);
}

static void start_connect(int id) {
  struct Client* c = &C[id];
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) die("socket");
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
  struct sockaddr_in src;
  memset(&src, 0, sizeof src);
  src.sin_family = AF_INET;
  src.sin_addr.s_addr = htonl((127u << 24) | (uint32_t)(first_source + id % n_sources));
  if (bind(fd, (struct sockaddr*)&src, sizeof src) != 0) die("bind (source address)");
  c->fd = fd;
  c->state = CONNECTING;
  struct epoll_event ev = {.events = EPOLLOUT | EPOLLIN, .data.u32 = (uint32_t)id};
  if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) != 0) die("epoll_ctl");
  if (connect(fd, (struct sockaddr*)&server_addr, sizeof server_addr) != 0 && errno != EINPROGRESS) {
    if (errno == ECONNREFUSED) ++refused;
    else ++other_errors;
    schedule_retry(id);
    return;
  }
  /* On loopback the kernel often completes the connect within the call: send the handshake at
   * once, as a client does when connect() returns, instead of after the next epoll_wait. */
  struct sockaddr_in peer;
  socklen_t plen = sizeof peer;
  if (getpeername(fd, (struct sockaddr*)&peer, &plen) == 0) connected(id);
}

static void want(struct Client* c, int id, uint32_t events) {
  struct epoll_event ev = {.events = events, .data.u32 = (uint32_t)id};
  epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
}

/* Sends what is queued; 0 on success (all sent or EAGAIN), -1 on error (errno). */
static int send_out(struct Client* c, int id) {
  while (c->out_off < c->out_len) {
    ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) break;
      return -1;
    }
    c->out_off = (uint16_t)(c->out_off + n);
  }
  want(c, id, c->out_off < c->out_len ? EPOLLIN | EPOLLOUT : EPOLLIN);
  return 0;
}

/* A connection lost: before its handshake reply it is retried, after it the client failed. */
static void lost(int id, int err, int eof) {
  struct Client* c = &C[id];
  if (c->state == CONNECTING) {
    if (err == ECONNREFUSED) ++refused;
    else if (err == ECONNRESET) ++reset_connect;
    else if (err == ETIMEDOUT) ++connect_timeouts;
    else ++other_errors;
    schedule_retry(id);
  } else if (c->state == HANDSHAKE) {
    if (eof) ++eof_handshake;
    else if (err == ECONNRESET) ++reset_handshake;
    else ++other_errors;
    schedule_retry(id);
  } else {
    fail_client(id, eof ? "closed by the server" : strerror(err));
  }
}

/* The length of the reply unit at the front of c->in, or 0 while incomplete. */
static size_t reply_len(struct Client* c) {
  if (proto == ECHO) return c->in_len >= kEchoBytes ? kEchoBytes : 0;
  if (proto == TORCH) {
    size_t need = c->state == HANDSHAKE ? 4 : c->state == ADDING ? 8 : 1;
    return c->in_len >= need ? need : 0;
  }
  if (c->in_len < 4) return 0;
  uint32_t body;
  memcpy(&body, c->in, 4);
  if (body < 5 || body > kBufBytes - 4) return (size_t)-1;
  return c->in_len >= 4 + body ? 4 + body : 0;
}

static void advance(int id, const char* r, size_t len) {
  struct Client* c = &C[id];
  int64_t value = 0;
  if (proto == NATIVE && r[4] != 0) {
    fail_client(id, "status not OK");
    return;
  }
  if (proto == TORCH && c->state == HANDSHAKE) {
    uint32_t v;
    memcpy(&v, r, 4);
    if (v != c->nonce) {
      fail_client(id, "PING reply is not the nonce");
      return;
    }
  }
  if (c->state == ADDING) memcpy(&value, proto == TORCH ? r : r + 9, 8);
  if (proto == TORCH && c->state == WAITING && r[0] != 0) {
    fail_client(id, "WAIT reply is not STOP_WAITING");
    return;
  }
  (void)len;
  if (--c->replies_left > 0) return;
  int64_t t = now_ns();
  switch (c->state) {
    case HANDSHAKE:
      if (t > last_handshake_ns) last_handshake_ns = t;
      if (proto == ECHO) {
        c->state = DONE;
        c->done_ns = t;
        ++done;
        return;
      }
      c->state = ADDING;
      queue_add(c);
      break;
    case ADDING:
      if (t > last_added_ns) last_added_ns = t;
      c->state = WAITING;
      queue_wait(c, value == n_clients);
      break;
    case WAITING:
      if (!first_done_ns) first_done_ns = t;
      c->state = DONE;
      c->done_ns = t;
      ++done;
      return;
    default:
      return;
  }
  if (send_out(c, id) != 0) lost(id, errno, 0);
}

static void on_event(int id, uint32_t events) {
  struct Client* c = &C[id];
  if (c->fd < 0 || c->state == DONE || c->state == FAILED || c->state == IDLE) return;
  if (c->state == CONNECTING) {
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err) return lost(id, err, 0);
    if (!(events & (EPOLLOUT | EPOLLIN))) return;
    return connected(id);
  }
  if (events & EPOLLOUT) {
    if (send_out(c, id) != 0) return lost(id, errno, 0);
  }
  if (!(events & (EPOLLIN | EPOLLERR | EPOLLHUP))) return;
  for (;;) {
    ssize_t n = recv(c->fd, c->in + c->in_len, kBufBytes - c->in_len, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) return;
      return lost(id, errno, 0);
    }
    if (n == 0) return lost(id, 0, 1);
    c->in_len = (uint16_t)(c->in_len + n);
    for (;;) {
      size_t len = reply_len(c);
      if (len == (size_t)-1) return fail_client(id, "malformed reply frame");
      if (len == 0) break;
      char r[kBufBytes];
      memcpy(r, c->in, len);
      memmove(c->in, c->in + len, c->in_len - len);
      c->in_len = (uint16_t)(c->in_len - len);
      advance(id, r, len);
      if (c->fd < 0 || c->state == DONE || c->state == FAILED) return;
    }
  }
}

static int cmp_i64(const void* a, const void* b) {
  int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
  return x < y ? -1 : x > y;
}

static double ms(int64_t ns) { return ns / 1e6; }

static int run_client(void) {
  if (n_clients <= 0 || n_clients > kMaxClients) {
    fprintf(stderr, "storm: --clients must be 1..%d\n", kMaxClients);
    return 2;
  }
  raise_nofile((rlim_t)n_clients + kFdHeadroom, (rlim_t)n_clients + kFdHeadroom);
  memset(&server_addr, 0, sizeof server_addr);
  server_addr.sin_family = AF_INET;
  server_addr.sin_port = htons((uint16_t)port);
  if (inet_pton(AF_INET, host, &server_addr.sin_addr) != 1) {
    fprintf(stderr, "storm: --host must be a numeric IPv4 address\n");
    return 2;
  }
  C = calloc((size_t)n_clients, sizeof *C);
  heap = calloc((size_t)n_clients, sizeof *heap);
  if (!C || !heap) die("calloc");
  for (int i = 0; i < n_clients; ++i) C[i].fd = -1;
  ep = epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) die("epoll_create1");
  srand(12345);
  struct epoll_event evs[kMaxEvents];
  int launched = 0;
  t0 = now_ns();
  const int64_t deadline = t0 + (int64_t)(timeout_s * 1e9);
  while (done + failed < n_clients) {
    int64_t t = now_ns();
    if (t > deadline) break;
    for (int k = 0; k < batch && launched < n_clients; ++k) start_connect(launched++);
    while (heap_n > 0 && heap[0].due_ns <= t) start_connect(heap_pop().id);
    int wait_ms = 0;
    if (launched >= n_clients) {
      int64_t next = deadline;
      if (heap_n > 0 && heap[0].due_ns < next) next = heap[0].due_ns;
      wait_ms = next > t ? (int)((next - t) / 1000000 + 1) : 0;
      if (wait_ms > 100) wait_ms = 100;
    }
    int n = epoll_wait(ep, evs, kMaxEvents, wait_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      die("epoll_wait");
    }
    for (int i = 0; i < n; ++i) on_event((int)evs[i].data.u32, evs[i].events);
  }
  const int64_t end = now_ns();
  int64_t* fin = malloc(sizeof(int64_t) * (size_t)(done > 0 ? done : 1));
  long m = 0;
  for (int i = 0; i < n_clients; ++i)
    if (C[i].state == DONE) fin[m++] = C[i].done_ns - t0;
  qsort(fin, (size_t)m, sizeof *fin, cmp_i64);
  const char* names[] = {"torch", "native", "echo"};
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  const double cpu_s = ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
                       (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
  printf("{\"proto\": \"%s\", \"clients\": %d, \"sources\": %d, \"done\": %ld, \"failed\": %ld, "
         "\"unfinished\": %ld, \"all_done_ms\": %.1f, \"p50_ms\": %.1f, \"p99_ms\": %.1f, "
         "\"last_connected_ms\": %.1f, \"last_handshake_ms\": %.1f, \"last_added_ms\": %.1f, "
         "\"first_done_ms\": %.1f, \"refused\": %ld, "
         "\"reset_at_connect\": %ld, \"reset_in_handshake\": %ld, \"closed_in_handshake\": %ld, "
         "\"connect_timeouts\": %ld, \"other_errors\": %ld, \"retries\": %ld, "
         "\"connects\": %ld, \"client_cpu_s\": %.3f}\n",
         names[proto], n_clients, n_sources, done, failed, n_clients - done - failed,
         done == n_clients ? ms(fin[m - 1]) : ms(end - t0), m ? ms(fin[m / 2]) : 0.0,
         m ? ms(fin[(m * 99) / 100 < m ? (m * 99) / 100 : m - 1]) : 0.0,
         ms(last_connected_ns ? last_connected_ns - t0 : 0),
         ms(last_handshake_ns ? last_handshake_ns - t0 : 0),
         ms(last_added_ns ? last_added_ns - t0 : 0), ms(first_done_ns ? first_done_ns - t0 : 0), refused, reset_connect,
         reset_handshake, eof_handshake, connect_timeouts, other_errors, retries, connected_total, cpu_s);
  fflush(stdout);
  if (hold) {
    char sink[64];
    while (read(0, sink, sizeof sink) > 0) {
    }
  }
  return done == n_clients ? 0 : 3;
}

/* ---- the echo floor ---- */
static int run_echo(int backlog) {
  raise_nofile(kMaxClients, kFdHeadroom);
  int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (lfd < 0) die("socket");
  int one = 1;
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  if (inet_pton(AF_INET, host, &a.sin_addr) != 1) {
    fprintf(stderr, "storm: --host must be a numeric IPv4 address\n");
    return 2;
  }
  if (bind(lfd, (struct sockaddr*)&a, sizeof a) != 0) die("bind");
  if (listen(lfd, backlog) != 0) die("listen");
  socklen_t len = sizeof a;
  getsockname(lfd, (struct sockaddr*)&a, &len);
  printf("storm echo listening on %s:%d\n", host, ntohs(a.sin_port));
  fflush(stdout);
  ep = epoll_create1(EPOLL_CLOEXEC);
  struct epoll_event ev = {.events = EPOLLIN, .data.fd = lfd};
  epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
  struct epoll_event evs[kMaxEvents];
  char buf[4096];
  for (;;) {
    int n = epoll_wait(ep, evs, kMaxEvents, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      die("epoll_wait");
    }
    for (int i = 0; i < n; ++i) {
      int fd = evs[i].data.fd;
      if (fd == lfd) {
        for (;;) {
          int c = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
          if (c < 0) break;
          setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          struct epoll_event cev = {.events = EPOLLIN, .data.fd = c};
          epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev);
        }
        continue;
      }
      ssize_t r = read(fd, buf, sizeof buf);
      if (r > 0) {
        if (write(fd, buf, (size_t)r) != r) close(fd);
      } else if (r == 0 || errno != EAGAIN) {
        close(fd);
      }
    }
  }
}

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc < 2) {
    fprintf(stderr, "usage: storm client|echo [options] (see storm.c)\n");
    return 2;
  }
  int backlog = 65535;
  for (int i = 2; i < argc; ++i) {
    const char* a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) {
      fprintf(stderr, "storm: %s needs a value\n", a);
      return 2;
    }
    ++i;
    if (!strcmp(a, "--host")) host = v;
    else if (!strcmp(a, "--port")) port = atoi(v);
    else if (!strcmp(a, "--clients")) n_clients = atoi(v);
    else if (!strcmp(a, "--sources")) n_sources = atoi(v);
    else if (!strcmp(a, "--first-source")) first_source = atoi(v);
    else if (!strcmp(a, "--batch")) batch = atoi(v);
    else if (!strcmp(a, "--retry-ms")) retry_ms = atol(v);
    else if (!strcmp(a, "--timeout-s")) timeout_s = atof(v);
    else if (!strcmp(a, "--key")) key = v;
    else if (!strcmp(a, "--backlog")) backlog = atoi(v);
    else if (!strcmp(a, "--hold")) hold = atoi(v);
    else if (!strcmp(a, "--proto")) {
      if (!strcmp(v, "torch")) proto = TORCH;
      else if (!strcmp(v, "native")) proto = NATIVE;
      else if (!strcmp(v, "echo")) proto = ECHO;
      else {
        fprintf(stderr, "storm: --proto must be torch, native or echo\n");
        return 2;
      }
    } else {
      fprintf(stderr, "storm: unknown option %s\n", a);
      return 2;
    }
  }
  if (n_sources < 1 || first_source < 1 || first_source + n_sources > kMaxSources + 1 ||
      batch < 1 || strlen(key) > 64) {
    fprintf(stderr, "storm: --sources/--first-source must name 127.0.0.1..127.0.0.%d, "
                    "--batch >= 1, --key at most 64 bytes\n", kMaxSources);
    return 2;
  }
  if (!strcmp(argv[1], "client")) return run_client();
  if (!strcmp(argv[1], "echo")) return run_echo(backlog);
  fprintf(stderr, "storm: unknown mode %s (client or echo)\n", argv[1]);
  return 2;
}
