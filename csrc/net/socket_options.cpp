#include "net/socket_options.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

namespace elasticstore {

bool set_nodelay(int fd) {
  const int one = 1;
  return ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0;
}

const char* set_keepalive(int fd, const KeepaliveOptions& opts) {
  const int on = 1;
  struct Option {
    int level, name;
    const void* value;
    socklen_t size;
    const char* label;
  };
  const Option options[] = {
      {SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on, "SO_KEEPALIVE"},
      {IPPROTO_TCP, TCP_KEEPIDLE, &opts.idle_s, sizeof opts.idle_s, "TCP_KEEPIDLE"},
      {IPPROTO_TCP, TCP_KEEPINTVL, &opts.interval_s, sizeof opts.interval_s, "TCP_KEEPINTVL"},
      {IPPROTO_TCP, TCP_KEEPCNT, &opts.count, sizeof opts.count, "TCP_KEEPCNT"},
  };
  for (const Option& o : options) {
    if (::setsockopt(fd, o.level, o.name, o.value, o.size) != 0) return o.label;
  }
  if (opts.user_timeout_ms != 0 &&
      ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &opts.user_timeout_ms,
                   sizeof opts.user_timeout_ms) != 0) {
    return "TCP_USER_TIMEOUT";
  }
  return nullptr;
}

}  // namespace elasticstore
