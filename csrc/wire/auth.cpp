#include "wire/auth.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>

namespace elasticstore {
namespace {

// Fixed-length labels, so that label || nonce || nonce has one parse.
constexpr char kClientLabel[] = "elasticstore/2 client proof";
constexpr char kServerLabel[] = "elasticstore/2 server proof";
static_assert(sizeof kClientLabel == sizeof kServerLabel, "labels of equal length");

constexpr uint8_t kMappedPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};

// The peer as (family, 4 or 16 address bytes); an IPv4-mapped IPv6 address counts as IPv4.
int peer_bytes(const sockaddr_storage& ss, const uint8_t** addr) noexcept {
  if (ss.ss_family == AF_INET) {
    *addr = reinterpret_cast<const uint8_t*>(&reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr);
    return AF_INET;
  }
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const uint8_t*>(&reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr);
    if (std::memcmp(a, kMappedPrefix, sizeof kMappedPrefix) == 0) {
      *addr = a + sizeof kMappedPrefix;
      return AF_INET;
    }
    *addr = a;
    return AF_INET6;
  }
  return 0;
}

bool prefix_match(const uint8_t* a, const uint8_t* b, unsigned bits) noexcept {
  const unsigned whole = bits / 8, rest = bits % 8;
  if (std::memcmp(a, b, whole) != 0) return false;
  if (rest == 0) return true;
  const auto mask = static_cast<uint8_t>(0xff << (8 - rest));
  return (a[whole] & mask) == (b[whole] & mask);
}

}  // namespace

std::string make_nonce() {
  std::string n(kAuthNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(&n[0]), static_cast<int>(n.size())) != 1) return {};
  return n;
}

std::string auth_mac(std::string_view token, AuthRole role, std::string_view client_nonce,
                     std::string_view server_nonce) {
  std::string msg(role == AuthRole::Client ? kClientLabel : kServerLabel, sizeof kClientLabel);
  msg.append(client_nonce.data(), client_nonce.size());
  msg.append(server_nonce.data(), server_nonce.size());
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
            reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), md, &len) ||
      len != kAuthMacBytes) {
    return {};  // never equal to a received MAC (mac_equal checks the length first)
  }
  return std::string(reinterpret_cast<const char*>(md), len);
}

bool mac_equal(std::string_view received, std::string_view expected) noexcept {
  if (expected.size() != kAuthMacBytes || received.size() != kAuthMacBytes) return false;
  return CRYPTO_memcmp(received.data(), expected.data(), kAuthMacBytes) == 0;
}

std::string token_problem(std::string_view token) {
  if (token.empty()) return "the token is empty";
  if (token.size() > kMaxTokenBytes)
    return "the token is " + std::to_string(token.size()) + " bytes, over the limit of " +
           std::to_string(kMaxTokenBytes);
  return {};
}

std::string read_token_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read the token file " + path + ": " + std::strerror(errno));
  std::string token;
  char buf[1024];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    token.append(buf, static_cast<std::size_t>(in.gcount()));
    if (token.size() > kMaxTokenBytes + 64) break;  // do not read a huge file whole
  }
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ' ||
                            token.back() == '\t'))
    token.pop_back();
  const std::string problem = token_problem(token);
  if (!problem.empty()) throw std::runtime_error("token file " + path + ": " + problem);
  return token;
}

bool parse_cidr(std::string_view text, Cidr* out, std::string* error) {
  const std::string s(text);
  const auto slash = s.find('/');
  const std::string addr = s.substr(0, slash);
  Cidr c;
  if (inet_pton(AF_INET, addr.c_str(), c.addr) == 1) {
    c.family = AF_INET;
  } else if (inet_pton(AF_INET6, addr.c_str(), c.addr) == 1) {
    c.family = AF_INET6;
  } else {
    *error = "not a numeric IPv4/IPv6 address or CIDR: '" + s + "'";
    return false;
  }
  const unsigned max_bits = c.family == AF_INET ? 32 : 128;
  c.prefix = max_bits;
  if (slash != std::string::npos) {
    const std::string bits = s.substr(slash + 1);
    if (bits.empty() || bits.size() > 3 || bits.find_first_not_of("0123456789") != std::string::npos ||
        std::stoul(bits) > max_bits) {
      *error = "bad prefix length in '" + s + "' (0.." + std::to_string(max_bits) + ")";
      return false;
    }
    c.prefix = static_cast<unsigned>(std::stoul(bits));
  }
  if (c.family == AF_INET6 && c.prefix >= 96 &&
      std::memcmp(c.addr, kMappedPrefix, sizeof kMappedPrefix) == 0) {  // ::ffff:a.b.c.d/n
    std::memmove(c.addr, c.addr + 12, 4);
    std::memset(c.addr + 4, 0, 12);
    c.family = AF_INET;
    c.prefix -= 96;
  }
  *out = c;
  return true;
}

std::string format_cidr(const Cidr& c) {
  char buf[INET6_ADDRSTRLEN] = {};
  inet_ntop(c.family, c.addr, buf, sizeof buf);
  return std::string(buf) + "/" + std::to_string(c.prefix);
}

bool cidr_contains(const Cidr& c, const sockaddr_storage& ss) noexcept {
  const uint8_t* a = nullptr;
  const int family = peer_bytes(ss, &a);
  return family != 0 && family == c.family && prefix_match(a, c.addr, c.prefix);
}

bool is_loopback(const sockaddr_storage& ss) noexcept {
  const uint8_t* a = nullptr;
  const int family = peer_bytes(ss, &a);
  if (family == AF_INET) return a[0] == 127;
  if (family == AF_INET6) return std::memcmp(a, &in6addr_loopback, 16) == 0;
  return false;
}

bool PeerAllowList::allows(const sockaddr_storage& ss) const {
  for (const Cidr& c : ranges_)
    if (cidr_contains(c, ss)) return true;
  std::lock_guard<std::mutex> lk(mu_);
  for (const Cidr& c : peers_)
    if (cidr_contains(c, ss)) return true;
  return false;
}

namespace {

// A vouched-for peer is one host: a range (wider than /32 or /128) is the operator's to allow.
bool parse_host(std::string_view text, Cidr* out, std::string* error) {
  if (!parse_cidr(text, out, error)) return false;
  if (out->prefix == (out->family == AF_INET ? 32u : 128u)) return true;
  *error = "'" + std::string(text) + "' is a range: only single addresses can be allowed at run " +
           "time (ranges: the server's --allow-unauthenticated-from)";
  return false;
}

}  // namespace

bool PeerAllowList::add(std::string_view text, std::string* error) {
  Cidr c;
  if (!parse_host(text, &c, error)) return false;
  std::lock_guard<std::mutex> lk(mu_);
  for (const Cidr& p : peers_)
    if (p.family == c.family && p.prefix == c.prefix && std::memcmp(p.addr, c.addr, 16) == 0) return true;
  if (peers_.size() >= kMaxAllowedPeers) {
    *error = "over the limit of " + std::to_string(kMaxAllowedPeers) + " allowed peers";
    return false;
  }
  peers_.push_back(c);
  return true;
}

bool PeerAllowList::set(const std::vector<std::string>& texts, std::string* error) {
  if (texts.size() > kMaxAllowedPeers) {
    *error = "over the limit of " + std::to_string(kMaxAllowedPeers) + " allowed peers";
    return false;
  }
  std::vector<Cidr> parsed(texts.size());
  for (std::size_t i = 0; i < texts.size(); ++i)
    if (!parse_host(texts[i], &parsed[i], error)) return false;
  std::lock_guard<std::mutex> lk(mu_);
  peers_ = std::move(parsed);
  return true;
}

std::vector<std::string> PeerAllowList::peers() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::string> out;
  for (const Cidr& c : peers_) out.push_back(format_cidr(c));
  return out;
}

// ---- the server's handshake ------------------------------------------------------------------

namespace {

void reply_message(std::string& out, Status status, uint32_t id, const std::string& message) {
  Writer w(out);
  w.begin_frame(static_cast<uint8_t>(status), id);
  w.bytes(message);
  w.end_frame();
}

HandshakeStep refuse(std::string& out, uint32_t id, const std::string& why, std::string* reason) {
  reply_message(out, Status::Unauthenticated, id, why);
  *reason = "authentication failed: " + why;
  return HandshakeStep::Refused;
}

}  // namespace

HandshakeStep ServerHandshake::on_frame(const ServerAuth& auth, Op op, uint32_t request_id,
                                        Reader& payload, uint64_t session_id, std::string& out,
                                        std::string* reason) {
  if (op == Op::Hello && !awaiting_auth()) return hello(auth, request_id, payload, session_id, out, reason);
  if (op == Op::Auth && awaiting_auth()) return this->auth(auth, request_id, payload, out, reason);
  *reason = std::string("frame ") + op_name(static_cast<uint8_t>(op)) + " during the handshake" +
            (awaiting_auth() ? " (expected AUTH)" : " (expected HELLO)");
  return HandshakeStep::Close;
}

HandshakeStep ServerHandshake::hello(const ServerAuth& auth, uint32_t id, Reader& r,
                                     uint64_t session, std::string& out, std::string* reason) {
  const uint32_t version = r.u32();
  if (version < kMinProtocolVersion || version > kProtocolVersion) {
    reply_message(out, Status::Error, id,
                  "unsupported protocol version " + std::to_string(version) + " (this server speaks " +
                      std::to_string(kMinProtocolVersion) + " to " + std::to_string(kProtocolVersion) + ")");
    return HandshakeStep::Pending;
  }
  r.bytes(kMaxClientNameBytes);
  // Version 1 (no authentication) has no nonce field; its reply has no server nonce.
  const std::string_view client_nonce = version >= 2 ? r.bytes(kAuthNonceBytes) : std::string_view();
  if (!r.done() || (!client_nonce.empty() && client_nonce.size() != kAuthNonceBytes)) {
    *reason = "malformed frame (opcode HELLO)";
    return HandshakeStep::Close;
  }
  if (!auth.required() && !client_nonce.empty())
    return refuse(out, id, "the client has a token but this server has none (start it with a "
                           "token, or connect without one)", reason);
  if (auth.required() && client_nonce.empty())
    return refuse(out, id, version < 2 ? "this server requires a token and protocol version 1 "
                                         "cannot carry one (upgrade the client)"
                                       : "this server requires a token and the client has none "
                                         "(give the client the server's token)",
                  reason);
  std::string nonce;
  if (auth.required()) {
    nonce = make_nonce();
    if (nonce.empty()) {  // no randomness: refuse rather than send a guessable nonce
      *reason = "RAND_bytes failed: cannot make a nonce";
      return HandshakeStep::Close;
    }
  }
  Writer w(out);
  w.begin_frame(static_cast<uint8_t>(Status::Ok), id);
  w.u32(version);
  w.u64(session);
  if (version >= 2) w.bytes(nonce);
  w.end_frame();
  if (!auth.required()) return HandshakeStep::Greeted;
  client_nonce_.assign(client_nonce.data(), client_nonce.size());
  server_nonce_ = std::move(nonce);
  return HandshakeStep::Pending;
}

HandshakeStep ServerHandshake::auth(const ServerAuth& auth, uint32_t id, Reader& r,
                                    std::string& out, std::string* reason) {
  const std::string_view client_mac = r.bytes(kAuthMacBytes);
  if (!r.done() || client_mac.size() != kAuthMacBytes) {
    *reason = "malformed frame (opcode AUTH)";
    return HandshakeStep::Close;
  }
  if (!mac_equal(client_mac, auth_mac(auth.token, AuthRole::Client, client_nonce_, server_nonce_)))
    return refuse(out, id, "wrong token (the client's proof does not match this server's token)", reason);
  Writer w(out);
  w.begin_frame(static_cast<uint8_t>(Status::Ok), id);
  w.bytes(auth_mac(auth.token, AuthRole::Server, client_nonce_, server_nonce_));
  w.end_frame();
  return HandshakeStep::Greeted;
}

}  // namespace elasticstore
