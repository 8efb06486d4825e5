/* LD_PRELOAD shim for the rendezvous benchmark (rendezvous_spread.py): every TCP connection a
 * thread opens to a loopback address leaves from that thread's own loopback source address,
 * as each node of a job connects from its own address. A thread picks its address with
 * es_bench_source("127.1.0.5") (from Python through ctypes) before its first connect; a thread
 * that picked none connects as usual. The socket is bound to (address, any port) just before
 * connect() unless it is bound already. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

#ifndef IP_BIND_ADDRESS_NO_PORT
#define IP_BIND_ADDRESS_NO_PORT 24
#endif

static __thread struct in_addr source;
static __thread int have_source;

int es_bench_source(const char *addr) {
  have_source = inet_pton(AF_INET, addr, &source) == 1;
  return have_source;
}

typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);

int connect(int fd, const struct sockaddr *sa, socklen_t len) {
  static connect_fn real = 0;
  if (!real) real = (connect_fn)dlsym(RTLD_NEXT, "connect");
  if (have_source && sa && sa->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
    const struct sockaddr_in *to = (const struct sockaddr_in *)sa;
    struct sockaddr_in mine;
    socklen_t mine_len = sizeof mine;
    int type = 0;
    socklen_t type_len = sizeof type;
    if ((ntohl(to->sin_addr.s_addr) >> 24) == 127 &&
        getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) == 0 && type == SOCK_STREAM &&
        getsockname(fd, (struct sockaddr *)&mine, &mine_len) == 0 && mine.sin_port == 0 &&
        mine.sin_addr.s_addr == 0) {
      int saved = errno, one = 1;
      memset(&mine, 0, sizeof mine);
      mine.sin_family = AF_INET;
      mine.sin_addr = source;
      setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
      bind(fd, (const struct sockaddr *)&mine, sizeof mine); /* on failure: as usual */
      errno = saved;
    }
  }
  return real(fd, sa, len);
}
