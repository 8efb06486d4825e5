// Authentication: the HMAC handshake codec (known vectors, binding of role, nonces and token),
// constant-time comparison, nonces, token files, the CIDR matcher and allow-list, and the
// handshake end to end between the C++ Client and Server.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "check.hpp"
#include "client/client.hpp"
#include "server/server.hpp"
#include "wire/auth.hpp"

using namespace elasticstore;

namespace {

std::string hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(d[c >> 4]);
    out.push_back(d[c & 15]);
  }
  return out;
}

std::string bytes_from(int start) {
  std::string s(kAuthNonceBytes, '\0');
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(start + static_cast<int>(i));
  return s;
}

sockaddr_storage v4(const char* a) {
  sockaddr_storage ss{};
  auto* in = reinterpret_cast<sockaddr_in*>(&ss);
  in->sin_family = AF_INET;
  inet_pton(AF_INET, a, &in->sin_addr);
  return ss;
}

sockaddr_storage v6(const char* a) {
  sockaddr_storage ss{};
  auto* in = reinterpret_cast<sockaddr_in6*>(&ss);
  in->sin6_family = AF_INET6;
  inet_pton(AF_INET6, a, &in->sin6_addr);
  return ss;
}

std::string temp_file(const std::string& content) {
  char path[] = "/tmp/elasticstore-token-XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd >= 0) {
    if (::write(fd, content.data(), content.size()) < 0) std::perror("write");
    ::close(fd);
  }
  return path;
}

ServerConfig config_with_token(const std::string& token) {
  ServerConfig c;
  c.log_level = LogLevel::Off;
  c.token = token;
  return c;
}

ClientOptions client_options(const std::string& token) {
  ClientOptions o;
  o.connect_timeout = std::chrono::milliseconds(3000);
  o.op_timeout = std::chrono::milliseconds(3000);
  o.token = token;
  return o;
}

// The error an attempt to connect raises: "" when it connects, "auth: ..." for AuthenticationError.
std::string connect_error(uint16_t port, const std::string& token) {
  try {
    Client c("127.0.0.1", port, client_options(token));
    c.set("k", "v");
    return "";
  } catch (const AuthenticationError& e) {
    return std::string("auth: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("other: ") + e.what();
  }
}

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

}  // namespace

// Computed independently with Python: hmac.new(b"token", label + cn + sn, hashlib.sha256).
TEST(mac_matches_known_vectors) {
  const std::string cn = bytes_from(0), sn = bytes_from(32);
  CHECK_EQ(hex(auth_mac("token", AuthRole::Client, cn, sn)),
           std::string("954cdc0ad587ff9e52ca18d78b266f0ba5fe6bdb1b9e943e4c27cb8f9c0672b8"));
  CHECK_EQ(hex(auth_mac("token", AuthRole::Server, cn, sn)),
           std::string("d40227fc8446f4c8ef211fc13db069534ca93efd2988c907e63c7629db1c3b8d"));
}

TEST(mac_binds_role_nonces_and_token) {
  const std::string cn = bytes_from(0), sn = bytes_from(32);
  const std::string m = auth_mac("token", AuthRole::Client, cn, sn);
  CHECK_EQ(m.size(), kAuthMacBytes);
  CHECK(m != auth_mac("token", AuthRole::Server, cn, sn));  // one side's proof is not the other's
  CHECK(m != auth_mac("token", AuthRole::Client, sn, cn));  // nonces swapped
  CHECK(m != auth_mac("token", AuthRole::Client, cn, bytes_from(33)));  // another server nonce
  CHECK(m != auth_mac("tokem", AuthRole::Client, cn, sn));
  CHECK(mac_equal(m, auth_mac("token", AuthRole::Client, cn, sn)));
}

TEST(mac_equal_refuses_other_lengths_and_values) {
  const std::string m = auth_mac("t", AuthRole::Client, bytes_from(0), bytes_from(1));
  CHECK(!mac_equal("", m));
  CHECK(!mac_equal(m.substr(0, kAuthMacBytes - 1), m));
  CHECK(!mac_equal(m + "x", m));
  std::string flipped = m;
  flipped[kAuthMacBytes - 1] = static_cast<char>(flipped[kAuthMacBytes - 1] ^ 1);
  CHECK(!mac_equal(flipped, m));
  CHECK(!mac_equal(m, ""));  // an expected MAC that failed to compute never matches
}

TEST(nonces_are_fresh) {
  const std::string a = make_nonce(), b = make_nonce();
  CHECK_EQ(a.size(), kAuthNonceBytes);
  CHECK_EQ(b.size(), kAuthNonceBytes);
  CHECK(a != b);
}

TEST(token_file_strips_the_final_newline_and_refuses_bad_ones) {
  const std::string ok = temp_file("s3cret\n");
  CHECK_EQ(read_token_file(ok), std::string("s3cret"));
  const std::string empty = temp_file("\n");
  bool threw = false;
  try {
    read_token_file(empty);
  } catch (const std::runtime_error& e) {
    threw = contains(e.what(), "empty");
  }
  CHECK(threw);
  const std::string big = temp_file(std::string(kMaxTokenBytes + 1, 'x'));
  threw = false;
  try {
    read_token_file(big);
  } catch (const std::runtime_error& e) {
    threw = contains(e.what(), "over the limit");
  }
  CHECK(threw);
  threw = false;
  try {
    read_token_file("/nonexistent/token");
  } catch (const std::runtime_error& e) {
    threw = contains(e.what(), "/nonexistent/token");
  }
  CHECK(threw);
  for (const auto& p : {ok, empty, big}) ::unlink(p.c_str());
}

TEST(cidr_parsing) {
  Cidr c;
  std::string err;
  CHECK(parse_cidr("10.0.0.0/8", &c, &err));
  CHECK_EQ(format_cidr(c), std::string("10.0.0.0/8"));
  CHECK(parse_cidr("10.1.2.3", &c, &err));
  CHECK_EQ(c.prefix, 32u);
  CHECK(parse_cidr("fd00::/8", &c, &err));
  CHECK_EQ(c.family, AF_INET6);
  CHECK(parse_cidr("::ffff:192.168.0.0/112", &c, &err));  // mapped: matched as IPv4
  CHECK_EQ(format_cidr(c), std::string("192.168.0.0/16"));
  for (const char* bad : {"", "10.0.0.0/33", "fd00::/129", "10.0.0.0/", "10.0.0.0/x", "host.example",
                          "10.0.0.0/8/8", "10.0.0.0/-1"}) {
    CHECK(!parse_cidr(bad, &c, &err));
  }
}

TEST(cidr_matching_ipv4_ipv6_and_mapped) {
  Cidr net;
  std::string err;
  CHECK(parse_cidr("10.1.0.0/16", &net, &err));
  CHECK(cidr_contains(net, v4("10.1.200.3")));
  CHECK(!cidr_contains(net, v4("10.2.0.1")));
  CHECK(cidr_contains(net, v6("::ffff:10.1.0.9")));  // a dual-stack listener's IPv4 peer
  CHECK(!cidr_contains(net, v6("fd00::1")));
  CHECK(parse_cidr("10.1.2.0/23", &net, &err));  // a prefix that is not byte-aligned
  CHECK(cidr_contains(net, v4("10.1.3.255")));
  CHECK(!cidr_contains(net, v4("10.1.4.0")));
  CHECK(parse_cidr("fd00:1::/32", &net, &err));
  CHECK(cidr_contains(net, v6("fd00:1::5")));
  CHECK(!cidr_contains(net, v6("fd00:2::5")));
  CHECK(!cidr_contains(net, v4("10.1.2.3")));
  CHECK(parse_cidr("0.0.0.0/0", &net, &err));
  CHECK(cidr_contains(net, v4("203.0.113.7")));
}

TEST(loopback) {
  CHECK(is_loopback(v4("127.0.0.1")));
  CHECK(is_loopback(v4("127.0.0.2")));
  CHECK(is_loopback(v6("::1")));
  CHECK(is_loopback(v6("::ffff:127.0.0.1")));
  CHECK(!is_loopback(v4("10.0.0.1")));
  CHECK(!is_loopback(v6("::2")));
}

TEST(allow_list) {
  Cidr range;
  std::string err;
  CHECK(parse_cidr("192.168.0.0/16", &range, &err));
  PeerAllowList with_loopback(true, {range});
  CHECK(with_loopback.loopback());  // loopback peers are checked by user (ServerAuth), not here
  CHECK(!with_loopback.allows(v4("127.0.0.1")));
  CHECK(with_loopback.allows(v4("192.168.4.4")));
  CHECK(!with_loopback.allows(v4("10.0.0.1")));
  CHECK(with_loopback.add("10.0.0.1", &err));
  CHECK(with_loopback.allows(v4("10.0.0.1")));
  CHECK(with_loopback.add("10.0.0.1", &err));  // twice: kept once
  CHECK_EQ(with_loopback.peers().size(), std::size_t{1});
  CHECK(!with_loopback.add("nonsense", &err));
  CHECK(!with_loopback.add("10.0.0.0/8", &err) && contains(err, "is a range"));  // hosts only
  CHECK(!with_loopback.add("0.0.0.0/0", &err) && !with_loopback.set({"::/0"}, &err));
  CHECK(with_loopback.add("10.0.0.3/32", &err));
  CHECK_EQ(with_loopback.peers().size(), std::size_t{2});
  CHECK(!with_loopback.set({"10.0.0.2", "bad"}, &err));  // all or nothing
  CHECK(with_loopback.allows(v4("10.0.0.1")));
  CHECK(with_loopback.set({"10.0.0.2"}, &err));
  CHECK(!with_loopback.allows(v4("10.0.0.1")));
  CHECK(with_loopback.allows(v4("192.168.4.4")));  // the operator's ranges stay
  PeerAllowList no_loopback(false, {});
  CHECK(!no_loopback.loopback() && !no_loopback.allows(v4("127.0.0.1")));
}

TEST(client_and_server_authenticate_each_other) {
  Server srv(config_with_token("s3cret"));
  srv.start();
  CHECK(srv.requires_token());
  CHECK_EQ(connect_error(srv.port(), "s3cret"), std::string());
  const std::string wrong = connect_error(srv.port(), "wrong");
  CHECK(contains(wrong, "auth: ") && contains(wrong, "wrong token"));
  const std::string none = connect_error(srv.port(), "");
  CHECK(contains(none, "auth: ") && contains(none, "requires a token"));
  Client c("127.0.0.1", srv.port(), client_options("s3cret"));
  CHECK(!c.try_get("k2"));  // the refused clients touched nothing
  const auto got = c.try_get("k");
  CHECK(got && got->first == "v");
}

TEST(client_with_token_refuses_a_server_without_one) {
  ServerConfig cfg = config_with_token("");
  Server srv(cfg);
  srv.start();
  CHECK(!srv.requires_token());
  const std::string e = connect_error(srv.port(), "s3cret");
  CHECK(contains(e, "auth: ") && contains(e, "has none"));
  CHECK_EQ(connect_error(srv.port(), ""), std::string());
}

TEST(server_refuses_bad_allow_lists) {
  ServerConfig cfg = config_with_token("t");
  cfg.allow_unauthenticated_from = {"10.0.0.0/40"};
  bool threw = false;
  try {
    Server srv(cfg);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  Server ok(config_with_token("t"));
  threw = false;
  try {
    ok.allow_peer("not an address");
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  ok.allow_peer("10.0.0.7");
  CHECK(ok.allowed_peers() == std::vector<std::string>{"10.0.0.7/32"});
  ok.start();
  Client c("127.0.0.1", ok.port(), client_options("t"));
  c.allow_peers({"fd00::8"});
  CHECK_EQ(ok.allowed_peers().size(), std::size_t{2});
  threw = false;
  try {
    c.allow_peers({"fd00::/8"});  // a range is the operator's to allow
  } catch (const StoreError& e) {
    threw = contains(e.what(), "is a range");
  }
  CHECK(threw);
  threw = false;
  try {
    c.allow_peers({"bad"});
  } catch (const StoreError& e) {
    threw = contains(e.what(), "ALLOW_PEERS");
  }
  CHECK(threw);
}

// ---- the server's handshake codec, without sockets ----------------------------------------------

namespace {

std::string hello_payload(uint32_t version, const std::string& nonce) {
  std::string p;
  Writer w(p);
  w.u32(version);
  w.bytes("unit");
  if (version >= 2) w.bytes(nonce);
  return p;
}

std::string bytes_payload(const std::string& b) {
  std::string p;
  Writer(p).bytes(b);
  return p;
}

struct Frame {
  uint8_t status = 0;
  uint32_t id = 0;
  std::string payload;
};

Frame parse_reply(const std::string& out) {
  FrameHeader h;
  Frame f;
  if (peek_frame(out.data(), out.size(), 1 << 20, &h) == FrameParse::Ready && h.total() == out.size()) {
    f.status = h.code;
    f.id = h.request_id;
    f.payload = out.substr(kFrameHeaderBytes);
  }
  return f;
}

HandshakeStep feed(ServerHandshake& hs, const ServerAuth& auth, Op op, uint32_t id,
                   const std::string& payload, std::string* out, std::string* reason) {
  out->clear();
  Reader r(payload);
  return hs.on_frame(auth, op, id, r, 77, *out, reason);
}

}  // namespace

TEST(handshake_codec_full_exchange_and_refusals) {
  const ServerAuth auth{"tok", PeerAllowList(true, {})};
  const std::string cn = make_nonce();
  std::string out, reason;
  ServerHandshake hs;
  CHECK(feed(hs, auth, Op::Hello, 1, hello_payload(2, cn), &out, &reason) == HandshakeStep::Pending);
  Frame f = parse_reply(out);
  CHECK_EQ(f.status, static_cast<uint8_t>(Status::Ok));
  Reader r(f.payload);
  CHECK_EQ(r.u32(), 2u);
  CHECK_EQ(r.u64(), 77ull);
  const std::string sn(r.bytes(kAuthNonceBytes));
  CHECK(r.done());
  CHECK_EQ(sn.size(), kAuthNonceBytes);
  CHECK(hs.awaiting_auth());
  // A second HELLO, or any other frame, while AUTH is expected: closed without a reply.
  ServerHandshake copy = hs;
  CHECK(feed(copy, auth, Op::Hello, 2, hello_payload(2, cn), &out, &reason) == HandshakeStep::Close);
  CHECK(out.empty() && contains(reason, "expected AUTH"));
  CHECK(feed(copy, auth, Op::Set, 2, "", &out, &reason) == HandshakeStep::Close);
  // A wrong proof: UNAUTHENTICATED, then close.
  copy = hs;
  CHECK(feed(copy, auth, Op::Auth, 2, bytes_payload(auth_mac("other", AuthRole::Client, cn, sn)), &out,
             &reason) == HandshakeStep::Refused);
  CHECK_EQ(parse_reply(out).status, static_cast<uint8_t>(Status::Unauthenticated));
  CHECK(contains(reason, "wrong token"));
  // The server's own proof reflected back: refused.
  copy = hs;
  CHECK(feed(copy, auth, Op::Auth, 2, bytes_payload(auth_mac("tok", AuthRole::Server, cn, sn)), &out,
             &reason) == HandshakeStep::Refused);
  // A MAC of the wrong size: malformed.
  copy = hs;
  CHECK(feed(copy, auth, Op::Auth, 2, bytes_payload("short"), &out, &reason) == HandshakeStep::Close);
  CHECK(out.empty() && contains(reason, "malformed frame (opcode AUTH)"));
  copy = hs;
  CHECK(feed(copy, auth, Op::Auth, 2, bytes_payload(std::string(kAuthMacBytes + 1, 'x')), &out,
             &reason) == HandshakeStep::Close);
  // The right proof: greeted, with the server's proof.
  const std::string proof = bytes_payload(auth_mac("tok", AuthRole::Client, cn, sn));
  CHECK(feed(hs, auth, Op::Auth, 3, proof, &out, &reason) == HandshakeStep::Greeted);
  f = parse_reply(out);
  CHECK_EQ(f.status, static_cast<uint8_t>(Status::Ok));
  CHECK_EQ(f.id, 3u);
  Reader rr(f.payload);
  CHECK(mac_equal(rr.bytes(kAuthMacBytes), auth_mac("tok", AuthRole::Server, cn, sn)));
  // Replayed on a new session (same client nonce): the server's nonce differs, the proof fails.
  ServerHandshake again;
  CHECK(feed(again, auth, Op::Hello, 1, hello_payload(2, cn), &out, &reason) == HandshakeStep::Pending);
  CHECK(feed(again, auth, Op::Auth, 3, proof, &out, &reason) == HandshakeStep::Refused);
}

TEST(handshake_codec_versions_and_missing_tokens) {
  const ServerAuth with{"tok", PeerAllowList(true, {})};
  const ServerAuth without{"", PeerAllowList(true, {})};
  std::string out, reason;
  {
    ServerHandshake hs;  // no token on either side: greeted at HELLO, empty server nonce
    CHECK(feed(hs, without, Op::Hello, 1, hello_payload(2, ""), &out, &reason) == HandshakeStep::Greeted);
    const Frame f = parse_reply(out);
    Reader r(f.payload);
    r.u32();
    r.u64();
    CHECK(r.bytes(kAuthNonceBytes).empty() && r.done());
  }
  {
    ServerHandshake hs;  // version 1 without a token: the version 1 reply
    CHECK(feed(hs, without, Op::Hello, 1, hello_payload(1, ""), &out, &reason) == HandshakeStep::Greeted);
    CHECK_EQ(parse_reply(out).payload.size(), std::size_t{12});
  }
  for (uint32_t v : {1u, 2u}) {
    ServerHandshake hs;  // a server with a token, a client without
    CHECK(feed(hs, with, Op::Hello, 1, hello_payload(v, ""), &out, &reason) == HandshakeStep::Refused);
    CHECK_EQ(parse_reply(out).status, static_cast<uint8_t>(Status::Unauthenticated));
  }
  {
    ServerHandshake hs;  // a client with a token, a server without
    CHECK(feed(hs, without, Op::Hello, 1, hello_payload(2, make_nonce()), &out, &reason) ==
          HandshakeStep::Refused);
    CHECK(contains(reason, "has none"));
  }
  {
    ServerHandshake hs;
    CHECK(feed(hs, with, Op::Hello, 1, hello_payload(2, std::string(16, 'n')), &out, &reason) ==
          HandshakeStep::Close);  // a nonce of the wrong size
    CHECK(feed(hs, with, Op::Hello, 1, hello_payload(99, ""), &out, &reason) == HandshakeStep::Pending);
    CHECK_EQ(parse_reply(out).status, static_cast<uint8_t>(Status::Error));
    CHECK(feed(hs, with, Op::Auth, 1, bytes_payload(std::string(32, 'm')), &out, &reason) ==
          HandshakeStep::Close);  // AUTH before HELLO
  }
}
