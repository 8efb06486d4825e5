/* LD_PRELOAD shim for the benchmarks: getnameinfo() never asks DNS for a name.
 *
 * torch's TCPStore client calls getnameinfo() on every connect (to format socket addresses).
 * On a machine whose resolver drops some PTR queries (this benchmark's sandbox does under
 * load) each lost query costs the resolver's 5 s timeout, which would swamp torch's connect
 * storm figures. With this shim a name lookup fails at once (as with a healthy resolver that
 * answers NXDOMAIN) or yields the numeric form. report.py loads it unless --real-dns. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>

typedef int (*getnameinfo_fn)(const struct sockaddr *, socklen_t, char *, socklen_t, char *,
                              socklen_t, int);

int getnameinfo(const struct sockaddr *sa, socklen_t salen, char *host, socklen_t hostlen,
                char *serv, socklen_t servlen, int flags) {
  static getnameinfo_fn real = 0;
  if (!real) real = (getnameinfo_fn)dlsym(RTLD_NEXT, "getnameinfo");
  if (host && hostlen && !(flags & NI_NUMERICHOST)) {
    if (flags & NI_NAMEREQD) return EAI_NONAME;
    flags |= NI_NUMERICHOST;
  }
  return real(sa, salen, host, hostlen, serv, servlen, flags);
}
