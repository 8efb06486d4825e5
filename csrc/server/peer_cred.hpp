// Torch TCPStore peers of a server with a token: who is served (ServerAuth's policy), and the
// kernel's word on which user runs a loopback peer.
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string>

#include "wire/auth.hpp"

namespace elasticstore {

// The user id owning the other end of a TCP connection `fd` from a process on this host (peer
// address `peer`), from the kernel's socket table. False with *error set when it is not found.
bool loopback_peer_uid(int fd, const sockaddr_storage& peer, uint32_t* uid, std::string* error);

// Whether a torch TCPStore client on connection `fd` from `peer` is served (always without a
// token); else *why says why not.
bool admits_torch(const ServerAuth& auth, int fd, const sockaddr_storage& peer, std::string* why);

}  // namespace elasticstore
