// The server's lifecycle and public API: construction (bind, listen), start/stop, statistics.
// Accepting is in accept.cpp, the connections' events in conns.cpp.
#include "server/server.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <exception>
#include <random>
#include <stdexcept>
#include <system_error>

#include "server/listener.hpp"
#include "server/server_impl.hpp"

namespace elasticstore {
namespace {

std::vector<Cidr> parse_ranges(const std::vector<std::string>& texts) {
  std::vector<Cidr> out(texts.size());
  std::string error;
  for (std::size_t i = 0; i < texts.size(); ++i)
    if (!parse_cidr(texts[i], &out[i], &error)) throw std::invalid_argument("allow_unauthenticated_from: " + error);
  return out;
}

const std::string& checked_token(const std::string& token) {
  if (!token.empty() && token.size() > kMaxTokenBytes) throw std::invalid_argument(token_problem(token));
  return token;
}

}  // namespace

Server::Impl::Impl(ServerConfig cfg)
    : cfg_(std::move(cfg)),
      auth_{checked_token(cfg_.token), PeerAllowList(cfg_.allow_loopback, parse_ranges(cfg_.allow_unauthenticated_from))},
      loop_(new EventLoop()),
      kv_(&EventLoop::now_ms, cfg_.limits) {
  auth_.torch_protocol = cfg_.torch_protocol;
  auth_.uid = static_cast<uint32_t>(::geteuid());
  std::string error;
  if (!auth_.allowed.set(cfg_.allowed_peers, &error)) throw std::invalid_argument("allowed_peers: " + error);
  listen_fd_ = open_listener(cfg_.host, cfg_.port, cfg_.backlog);
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  host_ = numeric_address(ss, false);
  port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  warn_if_exposed(ss);
  raise_fd_limit();
  reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  scratch_.resize(kReadScratchBytes);
  keepalive_note_ = keepalive_enabled(cfg_)
      ? "keepalive bound " + std::to_string(keepalive_bound_ms(cfg_)) + " ms (idle " +
            std::to_string(cfg_.keepalive_idle_ms) + " ms, then " + std::to_string(cfg_.keepalive_count) +
            " probes " + std::to_string(cfg_.keepalive_interval_ms) + " ms apart); its session ends"
      : "keepalive is off (the kernel's retransmission limit ended it); its session ends";
  if (!loop_->add(listen_fd_, kReadable, &Impl::on_accept, this)) {
    const int err = errno;
    close_fds();
    throw std::system_error(err, std::generic_category(), "epoll_ctl(listen)");
  }
  loop_->set_before_sleep([this] { before_sleep(); });
  publish();
}

void Server::Impl::start() {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopped_) throw std::runtime_error("a stopped Server cannot be restarted");
  if (thread_.joinable()) return;
  running_ = true;
  thread_ = std::thread([this] { run(); });
}

void Server::Impl::stop() noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopped_) return;
  stopped_ = true;
  if (thread_.joinable()) {
    loop_->stop();
    thread_.join();
  }
  running_ = false;
  publish();
  by_fd_.clear();
  dirty_.clear();
  closing_.clear();
  conns_.clear();  // each Connection closes its socket
  close_fds();
}

void Server::Impl::close_fds() noexcept {
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (reserve_fd_ >= 0) ::close(reserve_fd_);
  listen_fd_ = reserve_fd_ = -1;
  loop_.reset();  // the epoll fd and the wake-up eventfd
}

StatsList Server::Impl::stats_published() const {
  StatsList out;
  for (std::size_t i = 0; i < kNumStats; ++i) out.emplace_back(kStatNames[i], published_[i].load());
  return out;
}

// One line when a non-loopback address is bound without a token.
void Server::Impl::warn_if_exposed(const sockaddr_storage& ss) const {
  if (auth_.required() || is_loopback(ss)) return;
  log(LogLevel::Warning,
      "listening on %s:%u without a token: anyone who can reach this port can read and write "
      "every key (and torch's rendezvous unpickles what it reads); set a token (--token-file)",
      host_.c_str(), static_cast<unsigned>(port_));
}

StatsList Server::Impl::stats_snapshot() const {
  const auto v = collect();
  StatsList out;
  for (std::size_t i = 0; i < kNumStats; ++i) out.emplace_back(kStatNames[i], v[i]);
  return out;
}

void Server::Impl::run() noexcept {
  try {
    loop_->run();
  } catch (const std::exception& e) {
    log(LogLevel::Error, "event loop stopped by an exception: %s", e.what());
  } catch (...) {
    log(LogLevel::Error, "event loop stopped by an unknown exception");
  }
  running_ = false;
}

std::array<uint64_t, kNumStats> Server::Impl::collect() const {
  return {conns_.size() - closing_.size(), kv_.num_keys(),   kv_.waiter_count(), kv_.revision(),
          kv_.queue_count(),    kv_.history_size(), bytes_buffered_, accepted_,
          refused_,             closed_bad_input_, requests_, kv_.barrier_count(),
          closed_peer_lost_,    half_open_.size(), shed_half_open_,
          loop_ ? loop_->slowest_pass_ms() : 0, loop_ ? loop_->latest_wake_ms() : 0};
}

void Server::Impl::publish() noexcept {
  const auto v = collect();
  for (std::size_t i = 0; i < kNumStats; ++i) published_[i].store(v[i], std::memory_order_relaxed);
}

uint64_t first_session_id() noexcept {
  constexpr uint64_t kTagMask = (uint64_t{1} << (64 - kSessionCounterBits)) - 1;
  uint64_t tag = 0;
  try {
    std::random_device rd;
    tag = ((uint64_t{rd()} << 32) ^ rd()) & kTagMask;
  } catch (...) {  // no entropy source: the clock still tells two instances apart
    tag = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) & kTagMask;
  }
  if (tag == 0) tag = 1;
  return (tag << kSessionCounterBits) | 1;
}

Server::Server(ServerConfig config) {
  validate_config(config);
  set_log_level(config.log_level);
  impl_ = std::make_unique<Impl>(std::move(config));
}
Server::~Server() { stop(); }
const std::string& Server::host() const noexcept { return impl_->host(); }
uint16_t Server::port() const noexcept { return impl_->port(); }
void Server::start() { impl_->start(); }
void Server::stop() noexcept { impl_->stop(); }
bool Server::running() const noexcept { return impl_->running(); }
std::vector<std::pair<std::string, uint64_t>> Server::stats() const { return impl_->stats_published(); }
void Server::allow_peer(const std::string& addr) {
  std::string error;
  if (!impl_->server_auth().allowed.add(addr, &error)) throw std::invalid_argument(error);
}
void Server::set_allowed_peers(const std::vector<std::string>& addrs) {
  std::string error;
  if (!impl_->server_auth().allowed.set(addrs, &error)) throw std::invalid_argument(error);
}
std::vector<std::string> Server::allowed_peers() const { return impl_->server_auth().allowed.peers(); }
bool Server::requires_token() const noexcept { return impl_->server_auth().required(); }

}  // namespace elasticstore
