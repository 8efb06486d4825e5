#include "auth.hpp"

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
  if (loopback_ && is_loopback(ss)) return true;
  for (const Cidr& c : ranges_)
    if (cidr_contains(c, ss)) return true;
  std::lock_guard<std::mutex> lk(mu_);
  for (const Cidr& c : peers_)
    if (cidr_contains(c, ss)) return true;
  return false;
}

bool PeerAllowList::add(std::string_view text, std::string* error) {
  Cidr c;
  if (!parse_cidr(text, &c, error)) return false;
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
    if (!parse_cidr(texts[i], &parsed[i], error)) return false;
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

}  // namespace elasticstore
