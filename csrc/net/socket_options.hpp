// TCP socket options both sides set on a connected socket: no Nagle delay, and keepalive probes
// that find a peer gone silent (with a user timeout that bounds unacknowledged sends).
#pragma once

namespace elasticstore {

struct KeepaliveOptions {
  int idle_s = 0;      // TCP_KEEPIDLE
  int interval_s = 0;  // TCP_KEEPINTVL
  int count = 0;       // TCP_KEEPCNT
  unsigned user_timeout_ms = 0;  // TCP_USER_TIMEOUT; 0: left as the kernel has it
};

// Sets TCP_NODELAY; false when the kernel refused it (errno says why).
bool set_nodelay(int fd);

// Turns keepalive on with `opts`. Null when every option was set, else the name of the first one
// the kernel refused (errno says why); the options after it are not tried.
const char* set_keepalive(int fd, const KeepaliveOptions& opts);

}  // namespace elasticstore
