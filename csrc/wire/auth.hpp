// Authentication: the shared token, the HMAC-SHA256 challenge-response of the native handshake
// (docs/protocol.md, docs/authentication.md) and the allow-list of peers that may use torch's
// unauthenticated TCPStore protocol. Crypto is OpenSSL's libcrypto; no sockets here.
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "wire/protocol.hpp"

namespace elasticstore {

inline constexpr std::size_t kAuthNonceBytes = 32;   // each side's fresh random challenge
inline constexpr std::size_t kAuthMacBytes = 32;     // HMAC-SHA256
inline constexpr std::size_t kMaxTokenBytes = 4096;  // a token (or a token file's content)
inline constexpr std::size_t kMaxCidrBytes = 64;  // "ffff:...:ffff/128" fits
// A frame before the handshake finished (HELLO, AUTH): an unauthenticated peer cannot make the
// server buffer more than this.
inline constexpr std::size_t kMaxHandshakeFrameBytes = 1024;
inline constexpr std::size_t kMaxAllowedPeers = 65'536;  // vouched-for peers (PeerAllowList)

// Which side a MAC proves; bound into the MAC so that one side's proof is never the other's.
enum class AuthRole : uint8_t { Client = 1, Server = 2 };

// A fresh kAuthNonceBytes nonce from RAND_bytes; empty when the generator failed.
std::string make_nonce();
// HMAC-SHA256(token, label(role) || client_nonce || server_nonce): kAuthMacBytes bytes.
std::string auth_mac(std::string_view token, AuthRole role, std::string_view client_nonce,
                     std::string_view server_nonce);
// Constant-time (CRYPTO_memcmp) equality of a received MAC and the expected one.
bool mac_equal(std::string_view received, std::string_view expected) noexcept;
// Empty when `token` is usable (1..kMaxTokenBytes bytes), else why not.
std::string token_problem(std::string_view token);
// The token in a file: its content without trailing whitespace (a final newline). Throws
// std::runtime_error naming the file when it cannot be read, is empty or is too long.
std::string read_token_file(const std::string& path);

// An address range: "10.0.0.0/8", "fd00::/8", or one address ("10.1.2.3" is /32, "::1" /128).
struct Cidr {
  int family = 0;  // AF_INET or AF_INET6
  uint8_t addr[16] = {};
  unsigned prefix = 0;
};
// Parses a CIDR (or one address); false with *error set when it is not one.
bool parse_cidr(std::string_view text, Cidr* out, std::string* error);
std::string format_cidr(const Cidr& c);
// Whether `ss` (an IPv4, IPv6 or IPv4-mapped IPv6 peer) lies in `c`.
bool cidr_contains(const Cidr& c, const sockaddr_storage& ss) noexcept;
// 127.0.0.0/8, ::1 and ::ffff:127.0.0.0/104.
bool is_loopback(const sockaddr_storage& ss) noexcept;

// Who may speak torch's TCPStore protocol when the server has a token: loopback processes of the
// server's own user (unless loopback is turned off, for tests), the operator's ranges (fixed at
// start) and the hosts the job vouches for (changed at run time by Server::allow_peer and the
// native ALLOW_PEERS request; single addresses only, a range is the operator's to allow).
// Thread-safe: Python threads change it while the event loop reads it, once per torch connection.
class PeerAllowList {
 public:
  PeerAllowList(bool loopback, std::vector<Cidr> operator_ranges)
      : loopback_(loopback), ranges_(std::move(operator_ranges)) {}
  bool loopback() const noexcept { return loopback_; }
  // Whether `ss` is in an operator range or is a vouched-for host (loopback is not checked here).
  bool allows(const sockaddr_storage& ss) const;
  // Adds one address; false with *error set when it does not parse or is a range.
  bool add(std::string_view text, std::string* error);
  // Replaces the vouched-for hosts (not the operator's ranges); all or nothing.
  bool set(const std::vector<std::string>& texts, std::string* error);
  std::vector<std::string> peers() const;  // the vouched-for peers, as CIDRs

 private:
  const bool loopback_;
  const std::vector<Cidr> ranges_;
  mutable std::mutex mu_;
  std::vector<Cidr> peers_;
};

// The server's side of authentication, shared by its connections.
struct ServerAuth {
  std::string token;  // empty: no authentication (every peer served, any protocol)
  PeerAllowList allowed;
  // With a token: false refuses torch's protocol from every peer (a server only native clients
  // use, such as a rendezvous server).
  bool torch_protocol = true;
  uint32_t uid = 0;  // the server's effective user: loopback torch peers must run as it
  bool required() const noexcept { return !token.empty(); }
};

}  // namespace elasticstore

namespace elasticstore {

enum class HandshakeStep {
  Pending,  // replied; the handshake goes on (AUTH expected)
  Greeted,  // replied; the connection serves every opcode from now on
  Refused,  // replied UNAUTHENTICATED: send it, then close (*reason says why)
  Close,    // malformed or out of order: close without a reply (*reason says why)
};

// The server's side of the native handshake (docs/protocol.md), without sockets: one call per
// frame received before the handshake ended, its reply appended to `out`.
class ServerHandshake {
 public:
  HandshakeStep on_frame(const ServerAuth& auth, Op op, uint32_t request_id, Reader& payload,
                         uint64_t session_id, std::string& out, std::string* reason);
  bool awaiting_auth() const noexcept { return !server_nonce_.empty(); }

 private:
  HandshakeStep hello(const ServerAuth& auth, uint32_t id, Reader& r, uint64_t session,
                      std::string& out, std::string* reason);
  HandshakeStep auth(const ServerAuth& auth, uint32_t id, Reader& r, std::string& out,
                     std::string* reason);
  std::string client_nonce_, server_nonce_;  // set between HELLO and AUTH
};

}  // namespace elasticstore
