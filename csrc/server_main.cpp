// elasticstore-server: the store server as a native executable (no Python, no torch), for running
// as a daemon. The same flags and output as `elasticstore server`:
//
//   elasticstore-server [--host H] [--port P] [--backlog N] [--log-level L] [limit flags]
//                       [--token-file PATH] [--allow-unauthenticated-from CIDR]...
//                       [--torch-protocol {on,off}]
//
// The token: --token-file, else the file named by ELASTICSTORE_TOKEN_FILE, else ELASTICSTORE_TOKEN,
// else none (docs/authentication.md).
//
// prints "elasticstore server listening on H:P" once it accepts connections and serves until
// SIGINT or SIGTERM, then stops cleanly (exit 0). A bad flag exits 2 naming the flag and why; a
// failure to listen exits 1 with the reason.

#include <arpa/inet.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>

#include "net/lookup.hpp"
#include "server/server.hpp"
#include "wire/auth.hpp"

namespace {

using elasticstore::LogLevel;
using elasticstore::ServerConfig;

constexpr const char* kProg = "elasticstore-server";
constexpr int kDefaultPort = 29400;  // as `elasticstore server`
constexpr int kExitUsage = 2;
// A --host name (not a numeric address) is looked up forward once at start; a resolver that has
// not answered by then fails the start.
constexpr std::chrono::seconds kResolveTimeout{10};

const char* const kUsage =
    "usage: elasticstore-server [--host H] [--port P] [--backlog N] [--max-connections N]\n"
    "                           [--log-level {debug,info,warning,error,off}] [limit flags]\n"
    "                           [--token-file PATH] [--allow-unauthenticated-from CIDR]...\n"
    "                           [--torch-protocol {on,off}]\n"
    "\n"
    "Serves an elasticstore (native and torch TCPStore protocols on one port) until SIGINT or\n"
    "SIGTERM. --host: address or host name to bind (default 127.0.0.1; 0.0.0.0 or :: for every\n"
    "interface; a name is looked up forward once, never in reverse), --port: default 29400, 0\n"
    "picks a free one; --backlog: 0 uses somaxconn;\n"
    "--max-connections: default 65536; --log-level: default warning.\n"
    "--token-file: a file holding the shared token native clients must prove (default: the\n"
    "file named by $ELASTICSTORE_TOKEN_FILE, else $ELASTICSTORE_TOKEN, else no token); with a\n"
    "token, torch's TCPStore protocol is served only to loopback processes of the server's\n"
    "user, peers the job allows, and each --allow-unauthenticated-from range (IPv4 or IPv6\n"
    "CIDR, repeatable); --torch-protocol off refuses it from every peer (a rendezvous endpoint).\n"
    "\n"
    "Limits (docs/protocol.md; default in brackets):\n"
    "  --max-connections-per-peer N     connections from one IP address [8192]\n"
    "  --max-key-bytes N                a key, 1..8192 [8192]\n"
    "  --max-value-bytes N              a value, 1..8388608 [8388608]\n"
    "  --max-keys-per-request N         keys in one request, 1..131072 [131072]\n"
    "  --max-connection-buffer-bytes N  unsent replies of one connection, >= 1048576 [68157449]\n"
    "  --max-buffered-bytes N           buffered across connections [1073741824]\n"
    "  --max-waiters-per-connection N   blocked requests of one connection [16384]\n"
    "  --max-stored-keys N              keys plus queued items stored [16777216]\n"
    "  --max-stored-bytes N             their key and value bytes [4294967296]\n"
    "  --frame-timeout-ms N             time to finish a request once started [30000]\n"
    "  --handshake-timeout-ms N         time from connect to the end of the handshake [10000]\n"
    "  --barrier-idle-ms N              an idle released barrier name is forgotten after [600000]\n"
    "\n"
    "Dead peers (TCP keepalive; a peer gone without FIN/RST is closed and its session keys\n"
    "dropped after idle + interval * count ms, 16 s by default; 0 in any of them: off):\n"
    "  --keepalive-idle-ms N            silence before the first probe, whole seconds [10000]\n"
    "  --keepalive-interval-ms N        between probes, whole seconds [2000]\n"
    "  --keepalive-count N              unanswered probes that end it, 0..127 [3]\n";

constexpr long long kHuge = 1LL << 50;

[[noreturn]] void bad_flag(const std::string& flag, const std::string& why) {
  std::fprintf(stderr, "%s: argument %s: %s\n%s", kProg, flag.c_str(), why.c_str(), kUsage);
  std::exit(kExitUsage);
}

// A whole decimal number in [lo, hi], else the flag is refused with `what`.
long long parse_int(const std::string& flag, const char* text, long long lo, long long hi,
                    const char* what) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < lo || v > hi) {
    bad_flag(flag, std::string(text) + " is not " + what);
  }
  return v;
}

LogLevel parse_level(const std::string& flag, const std::string& text) {
  if (text == "debug") return LogLevel::Debug;
  if (text == "info") return LogLevel::Info;
  if (text == "warning") return LogLevel::Warning;
  if (text == "error") return LogLevel::Error;
  if (text == "off") return LogLevel::Off;
  bad_flag(flag, "invalid choice: '" + text + "' (choose from debug, info, warning, error, off)");
}

// The limit flags: true when `flag` is one (its value parsed into cfg, or refused).
bool parse_limit(ServerConfig& cfg, const std::string& flag, const std::string& value) {
  const char* v = value.c_str();
  auto size = [&](long long lo, long long hi, const char* what) {
    return static_cast<std::size_t>(parse_int(flag, v, lo, hi, what));
  };
  auto ms = [&] { return static_cast<uint32_t>(parse_int(flag, v, 1, 0xFFFFFFFELL, "milliseconds >= 1")); };
  using namespace elasticstore;
  StoreLimits& lim = cfg.limits;
  if (flag == "--max-connections-per-peer") {
    cfg.max_connections_per_peer = size(1, kHuge, "a connection count >= 1");
  } else if (flag == "--max-key-bytes") {
    lim.max_key_bytes = size(1, kMaxKeyBytes, "a size in 1..8192 (the protocol's ceiling)");
  } else if (flag == "--max-value-bytes") {
    lim.max_value_bytes = size(1, kMaxValueBytes, "a size in 1..8388608 (the protocol's ceiling)");
  } else if (flag == "--max-keys-per-request") {
    lim.max_keys_per_request = size(1, kMaxKeysPerRequest, "a count in 1..131072 (the protocol's ceiling)");
  } else if (flag == "--max-connection-buffer-bytes") {
    cfg.max_connection_buffer_bytes =
        size(kOutputPauseBytes, kHuge, "a size >= 1048576 (the bound at which reading pauses)");
  } else if (flag == "--max-buffered-bytes") {
    cfg.max_buffered_bytes = size(1, kHuge, "a size >= 1");
  } else if (flag == "--max-waiters-per-connection") {
    lim.max_waiters_per_connection = size(1, kHuge, "a count >= 1");
  } else if (flag == "--max-stored-keys") {
    lim.max_stored_keys = size(1, kHuge, "a count >= 1");
  } else if (flag == "--max-stored-bytes") {
    lim.max_stored_bytes = size(1, kHuge, "a size >= 1");
  } else if (flag == "--frame-timeout-ms") {
    cfg.frame_timeout_ms = ms();
  } else if (flag == "--handshake-timeout-ms") {
    cfg.handshake_timeout_ms = ms();
  } else if (flag == "--barrier-idle-ms") {
    lim.barrier_idle_ms = ms();
  } else if (flag == "--keepalive-idle-ms" || flag == "--keepalive-interval-ms") {
    const auto t = static_cast<uint32_t>(
        parse_int(flag, v, 0, kKeepaliveMaxMs, "0 (off) or milliseconds in 1000..32767000"));
    if (t % 1000 != 0) bad_flag(flag, value + " is not a whole number of seconds (TCP keepalive counts seconds)");
    (flag == "--keepalive-idle-ms" ? cfg.keepalive_idle_ms : cfg.keepalive_interval_ms) = t;
  } else if (flag == "--keepalive-count") {
    cfg.keepalive_count =
        static_cast<uint32_t>(parse_int(flag, v, 0, kKeepaliveMaxCount, "0 (off) or a count in 1..127"));
  } else {
    return false;
  }
  return true;
}

// The token by precedence: --token-file, $ELASTICSTORE_TOKEN_FILE, $ELASTICSTORE_TOKEN. A file
// that cannot be read, or an empty or oversized token, exits 2.
std::string load_token(std::string file) {
  const char* from = "--token-file";
  if (file.empty()) {
    const char* env_file = std::getenv("ELASTICSTORE_TOKEN_FILE");
    if (env_file && *env_file) {
      file = env_file;
      from = "ELASTICSTORE_TOKEN_FILE";
    }
  }
  try {
    if (!file.empty()) return elasticstore::read_token_file(file);
  } catch (const std::exception& e) {
    bad_flag(from, e.what());
  }
  const char* env = std::getenv("ELASTICSTORE_TOKEN");
  if (!env || !*env) return {};
  const std::string problem = elasticstore::token_problem(env);
  if (!problem.empty()) bad_flag("ELASTICSTORE_TOKEN", problem);
  return env;
}

bool is_numeric_host(const std::string& host) {
  unsigned char buf[sizeof(in6_addr)];
  return ::inet_pton(AF_INET, host.c_str(), buf) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), buf) == 1;
}

// The first address a forward lookup of `host` gives, as numeric text; exits 2 naming --host
// when there is none or the resolver does not answer within kResolveTimeout.
std::string resolve_host(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const auto lookup = elasticstore::start_lookup(host, "", hints);
  std::unique_lock<std::mutex> lock(lookup->mu);
  if (!lookup->cv.wait_for(lock, kResolveTimeout, [&] { return lookup->done; })) {
    bad_flag("--host", "'" + host + "' did not resolve within " +
                           std::to_string(kResolveTimeout.count()) + " s");
  }
  const addrinfo* ai = lookup->res;
  if (lookup->rc != 0 || ai == nullptr) {
    bad_flag("--host", "cannot resolve '" + host + "': " +
                           (lookup->rc != 0 ? ::gai_strerror(lookup->rc) : "no address"));
  }
  char text[INET6_ADDRSTRLEN] = {0};
  const void* addr =
      ai->ai_family == AF_INET6
          ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(ai->ai_addr)->sin6_addr)
          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(ai->ai_addr)->sin_addr);
  ::inet_ntop(ai->ai_family, addr, text, sizeof text);  // formatting only: no lookup
  return text;
}

ServerConfig parse_args(int argc, char** argv) {
  ServerConfig cfg;
  cfg.port = kDefaultPort;
  std::string token_file;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    std::string value;
    const auto eq = flag.find('=');
    if (flag.rfind("--", 0) == 0 && eq != std::string::npos) {  // --port=0
      value = flag.substr(eq + 1);
      flag.resize(eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else if (flag.rfind("--", 0) == 0 && flag.size() > 2) {
      bad_flag(flag, std::strstr(kUsage, (flag + " ").c_str()) ? "expected one argument"
                                                               : "unrecognized argument");
    } else {
      bad_flag(flag, "unrecognized argument");
    }
    if (flag == "--host") {
      if (value.empty()) bad_flag(flag, "an empty host");
      cfg.host = value;
    } else if (flag == "--port") {
      cfg.port = static_cast<uint16_t>(
          parse_int(flag, value.c_str(), 0, 65535, "a port number (0..65535)"));
    } else if (flag == "--backlog") {
      cfg.backlog = static_cast<int>(parse_int(flag, value.c_str(), 0, 1 << 30, "a backlog >= 0"));
    } else if (flag == "--max-connections") {
      cfg.max_connections = static_cast<std::size_t>(
          parse_int(flag, value.c_str(), 1, 1LL << 40, "a connection count >= 1"));
    } else if (flag == "--log-level") {
      cfg.log_level = parse_level(flag, value);
    } else if (flag == "--token-file") {
      token_file = value;
    } else if (flag == "--torch-protocol") {
      if (value != "on" && value != "off") bad_flag(flag, "expected on or off, got '" + value + "'");
      cfg.torch_protocol = value == "on";
    } else if (flag == "--allow-unauthenticated-from") {
      elasticstore::Cidr c;
      std::string error;
      if (!elasticstore::parse_cidr(value, &c, &error)) bad_flag(flag, error);
      cfg.allow_unauthenticated_from.push_back(value);
    } else if (parse_limit(cfg, flag, value)) {
    } else {
      bad_flag(flag, "unrecognized argument");
    }
  }
  cfg.token = load_token(token_file);
  if (cfg.host != "localhost" && !is_numeric_host(cfg.host)) cfg.host = resolve_host(cfg.host);
  return cfg;
}

std::string format_address(const std::string& host, uint16_t port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace

int main(int argc, char** argv) {
  const ServerConfig cfg = parse_args(argc, argv);
  // Block the stop signals before any thread starts, so that only sigwait() below takes them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  if (pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr) != 0) {
    std::fprintf(stderr, "%s: cannot block SIGINT/SIGTERM\n", kProg);
    return 1;
  }
  try {
    elasticstore::Server server(cfg);
    server.start();
    std::printf("elasticstore server listening on %s\n",
                format_address(server.host(), server.port()).c_str());
    std::fflush(stdout);
    int sig = 0;
    while (sigwait(&stop_signals, &sig) != 0) {
    }
    server.stop();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", kProg, e.what());
    return 1;
  }
  return 0;
}
