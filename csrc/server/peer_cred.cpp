// Which torch TCPStore peers a server with a token serves, and the user owning the other end of a
// loopback TCP connection, from the kernel's socket table (NETLINK_SOCK_DIAG, as `ss -e` reads
// it): a TCP peer has no SO_PEERCRED. The peer's socket is the one whose local address is the
// connection's remote one, and the other way round.
#include <arpa/inet.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "server/peer_cred.hpp"

namespace elasticstore {

namespace {

// IPv4 (or IPv4-mapped IPv6) address and port of `ss`, as the IPv4 socket table holds them.
bool as_ipv4(const sockaddr_storage& ss, uint32_t* addr, uint16_t* port) {
  if (ss.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
    *addr = in->sin_addr.s_addr;
    *port = in->sin_port;
    return true;
  }
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
  if (ss.ss_family != AF_INET6 || !IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) return false;
  std::memcpy(addr, in6->sin6_addr.s6_addr + 12, 4);
  *port = in6->sin6_port;
  return true;
}

// One exact lookup in `family`'s TCP table; 1 found (uid set), 0 no such socket, -1 error.
int lookup(int family, const sockaddr_storage& peer, const sockaddr_storage& local, uint32_t* uid,
           std::string* error) {
  struct {
    nlmsghdr nlh;
    inet_diag_req_v2 req;
  } msg{};
  msg.nlh.nlmsg_len = sizeof msg;
  msg.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  msg.nlh.nlmsg_flags = NLM_F_REQUEST;
  msg.req.sdiag_family = static_cast<uint8_t>(family);
  msg.req.sdiag_protocol = IPPROTO_TCP;
  msg.req.idiag_states = ~0u;
  inet_diag_sockid& id = msg.req.id;
  id.idiag_cookie[0] = id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  if (family == AF_INET) {
    uint32_t src = 0, dst = 0;
    if (!as_ipv4(peer, &src, &id.idiag_sport) || !as_ipv4(local, &dst, &id.idiag_dport)) return 0;
    id.idiag_src[0] = src;
    id.idiag_dst[0] = dst;
  } else {
    if (peer.ss_family != AF_INET6 || local.ss_family != AF_INET6) return 0;
    const auto* p = reinterpret_cast<const sockaddr_in6*>(&peer);
    const auto* l = reinterpret_cast<const sockaddr_in6*>(&local);
    std::memcpy(id.idiag_src, &p->sin6_addr, 16);
    std::memcpy(id.idiag_dst, &l->sin6_addr, 16);
    id.idiag_sport = p->sin6_port;
    id.idiag_dport = l->sin6_port;
  }
  const int nl = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (nl < 0) {
    *error = std::string("netlink socket: ") + std::strerror(errno);
    return -1;
  }
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  int result = -1;
  alignas(nlmsghdr) char buf[8192];
  if (::sendto(nl, &msg, sizeof msg, 0, reinterpret_cast<sockaddr*>(&kernel), sizeof kernel) < 0) {
    *error = std::string("sock_diag request: ") + std::strerror(errno);
  } else if (const ssize_t n = ::recv(nl, buf, sizeof buf, 0); n < 0) {
    *error = std::string("sock_diag reply: ") + std::strerror(errno);
  } else {
    const auto* h = reinterpret_cast<const nlmsghdr*>(buf);
    const auto len = static_cast<unsigned>(n);
    if (!NLMSG_OK(h, len)) {
      *error = "sock_diag reply: truncated";
    } else if (h->nlmsg_type == NLMSG_ERROR) {
      const auto* e = static_cast<const nlmsgerr*>(NLMSG_DATA(h));
      if (e->error == -ENOENT) {
        result = 0;
      } else {
        *error = std::string("sock_diag: ") + std::strerror(-e->error);
      }
    } else if (h->nlmsg_type == SOCK_DIAG_BY_FAMILY &&
               h->nlmsg_len >= NLMSG_LENGTH(sizeof(inet_diag_msg))) {
      *uid = static_cast<const inet_diag_msg*>(NLMSG_DATA(h))->idiag_uid;
      result = 1;
    } else {
      *error = "sock_diag reply: unexpected message";
    }
  }
  ::close(nl);
  return result;
}

}  // namespace

bool loopback_peer_uid(int fd, const sockaddr_storage& peer, uint32_t* uid, std::string* error) {
  sockaddr_storage local{};
  socklen_t len = sizeof local;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) {
    *error = std::string("getsockname: ") + std::strerror(errno);
    return false;
  }
  // The peer's socket may be IPv4 while ours is IPv6 (a dual-stack listener): try both tables.
  for (const int family : {AF_INET, AF_INET6}) {
    const int found = lookup(family, peer, local, uid, error);
    if (found != 0) return found == 1;
  }
  *error = "its socket is not in this host's table (not a local process)";
  return false;
}

bool admits_torch(const ServerAuth& auth, int fd, const sockaddr_storage& peer, std::string* why) {
  if (!auth.required()) return true;
  if (!auth.torch_protocol) {
    *why = "this server has a token and serves only native clients that prove it";
    return false;
  }
  if (auth.allowed.loopback() && is_loopback(peer)) {
    uint32_t peer_uid = 0;
    std::string error;
    if (!loopback_peer_uid(fd, peer, &peer_uid, &error)) {
      *why = "the server has a token and cannot tell which user this loopback peer runs as (" +
             error + ")";
      return false;
    }
    if (peer_uid == auth.uid) return true;
    *why = "the server has a token and this loopback peer runs as uid " + std::to_string(peer_uid) +
           ", not the server's uid " + std::to_string(auth.uid);
    return false;
  }
  if (auth.allowed.allows(peer)) return true;
  *why = "the server has a token and this peer is neither a loopback process of the server's "
         "user, nor an allowed peer, nor in an --allow-unauthenticated-from range";
  return false;
}

}  // namespace elasticstore
