// Listening-socket set-up for the server: resolve, bind, listen; numeric address formatting.
#include "server/listener.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <stdexcept>
#include <system_error>

namespace elasticstore {

std::string numeric_address(const sockaddr_storage& ss, bool with_port) {
  char buf[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof buf);
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof buf);
    port = ntohs(a->sin6_port);
  }
  if (!with_port) return buf;
  return (ss.ss_family == AF_INET6 ? "[" + std::string(buf) + "]" : std::string(buf)) + ":" +
         std::to_string(port);
}

namespace {

int default_backlog() {
  int v = 0;
  if (FILE* f = std::fopen("/proc/sys/net/core/somaxconn", "re")) {
    if (std::fscanf(f, "%d", &v) != 1) v = 0;
    std::fclose(f);
  }
  return v > 0 ? std::min(v, kMaxListenBacklog) : SOMAXCONN;
}

}  // namespace

// Binds the first address the host resolves to. Numeric hosts only, except "localhost", which is
// resolved forward; nothing here (or anywhere) does a reverse lookup.
int open_listener(const std::string& host, uint16_t port, int backlog) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV | (host == "localhost" ? 0 : AI_NUMERICHOST);
  const std::string service = std::to_string(port);
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(),
                               &hints, &res);
  if (rc != 0)
    throw std::runtime_error("cannot resolve host '" + host +
                             "' (numeric addresses or localhost only): " + ::gai_strerror(rc));
  int err = 0;
  int fd = -1;
  for (addrinfo* ai = res; ai && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    const int one = 1, zero = 0;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (ai->ai_family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 ||
        ::listen(fd, backlog > 0 ? backlog : default_backlog()) != 0) {
      err = errno;
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd < 0)
    throw std::system_error(err, std::generic_category(),
                            "cannot listen on " + host + ":" + service);
  return fd;
}

}  // namespace elasticstore
