// The server's listening socket: resolve, bind, listen. Numeric addresses only (no reverse DNS).
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string>


namespace elasticstore {

// The numeric form of an address ("::1", "127.0.0.1"); with_port: "[::1]:80", "127.0.0.1:80".
std::string numeric_address(const sockaddr_storage& ss, bool with_port);

// The listen backlog when ServerConfig::backlog is 0: net.core.somaxconn (the kernel's own cap on
// it), up to this. Connections the kernel completed wait there until accepted; when it is full,
// a connect is dropped and its client's kernel retries only after its 1 s SYN timeout, so a job
// whose ranks all connect at once wants it as large as the ranks (raise somaxconn to match).
inline constexpr int kMaxListenBacklog = 65'536;

// A non-blocking listening socket bound to host:port (ServerConfig's host, port and backlog;
// backlog 0: min(somaxconn, kMaxListenBacklog)). Throws std::runtime_error when the host does not resolve,
// std::system_error when binding fails.
int open_listener(const std::string& host, uint16_t port, int backlog);

}  // namespace elasticstore
