// elasticstore._C.Server: the native server for Python (see _C.pyi). start() and stop() run with
// the GIL released.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "python/bindings.hpp"
#include "python/py_interop.hpp"
#include "server/server.hpp"
#include "wire/auth.hpp"
#include "wire/protocol.hpp"

namespace py = pybind11;
namespace es = elasticstore;
using namespace elasticstore::py_interop;

namespace elasticstore::bindings {
namespace {

class PyServer {
 public:
  // A limit out of range raises ValueError naming it (std::invalid_argument from the Server).
  PyServer(const std::string& host, int port, int backlog, std::size_t max_connections,
           const std::string& log_level, std::size_t max_connections_per_peer,
           std::size_t max_key_bytes, std::size_t max_value_bytes, std::size_t max_keys_per_request,
           std::size_t max_connection_buffer_bytes, std::size_t max_buffered_bytes,
           std::size_t max_waiters_per_connection, std::size_t max_stored_keys,
           std::size_t max_stored_bytes, uint32_t frame_timeout_ms, uint32_t handshake_timeout_ms,
           uint32_t keepalive_idle_ms, uint32_t keepalive_interval_ms, uint32_t keepalive_count,
           const std::string& token, const std::vector<std::string>& allow_unauthenticated_from,
           const std::vector<std::string>& allowed_peers, bool allow_loopback,
           uint32_t barrier_idle_ms, bool torch_protocol) {
    if (port < 0 || port > 65535) throw py::value_error("port must be in [0, 65535]");
    es::ServerConfig config;
    config.host = host;
    config.port = static_cast<uint16_t>(port);
    config.backlog = backlog;
    config.max_connections = max_connections;
    config.log_level = parse_log_level(log_level);
    config.max_connections_per_peer = max_connections_per_peer;
    config.limits.max_key_bytes = max_key_bytes;
    config.limits.max_value_bytes = max_value_bytes;
    config.limits.max_keys_per_request = max_keys_per_request;
    config.max_connection_buffer_bytes = max_connection_buffer_bytes;
    config.max_buffered_bytes = max_buffered_bytes;
    config.limits.max_waiters_per_connection = max_waiters_per_connection;
    config.limits.max_stored_keys = max_stored_keys;
    config.limits.max_stored_bytes = max_stored_bytes;
    config.frame_timeout_ms = frame_timeout_ms;
    config.handshake_timeout_ms = handshake_timeout_ms;
    config.keepalive_idle_ms = keepalive_idle_ms;
    config.keepalive_interval_ms = keepalive_interval_ms;
    config.keepalive_count = keepalive_count;
    if (!token.empty() && !es::token_problem(token).empty())
      throw py::value_error(es::token_problem(token));
    config.token = token;
    config.allow_unauthenticated_from = allow_unauthenticated_from;
    config.allowed_peers = allowed_peers;
    config.allow_loopback = allow_loopback;
    config.limits.barrier_idle_ms = barrier_idle_ms;
    config.torch_protocol = torch_protocol;
    server_ = std::make_unique<es::Server>(config);
  }
  ~PyServer() {
    // Joining the loop thread must not hold the GIL (the destructor runs with it held).
    if (server_ && Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release release;
      server_.reset();
    }
  }
  es::Server& get() { return *server_; }

 private:
  std::unique_ptr<es::Server> server_;
};

}  // namespace

void bind_server(py::module_& m) {
  py::class_<PyServer>(m, "Server")
      .def(py::init<const std::string&, int, int, std::size_t, const std::string&, std::size_t,
                    std::size_t, std::size_t, std::size_t, std::size_t, std::size_t, std::size_t,
                    std::size_t, std::size_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t,
                    const std::string&,
                    const std::vector<std::string>&, const std::vector<std::string>&, bool,
                    uint32_t, bool>(),
           py::arg("host") = "127.0.0.1", py::arg("port") = 0, py::kw_only(),
           py::arg("backlog") = 0, py::arg("max_connections") = es::kDefaultMaxConnections,
           py::arg("log_level") = "warning",
           py::arg("max_connections_per_peer") = es::kDefaultMaxConnectionsPerPeer,
           py::arg("max_key_bytes") = es::kMaxKeyBytes, py::arg("max_value_bytes") = es::kMaxValueBytes,
           py::arg("max_keys_per_request") = es::kMaxKeysPerRequest,
           py::arg("max_connection_buffer_bytes") = es::kMaxWriteBufferBytes,
           py::arg("max_buffered_bytes") = es::kMaxBufferedBytes,
           py::arg("max_waiters_per_connection") = es::kDefaultMaxWaitersPerConnection,
           py::arg("max_stored_keys") = es::kDefaultMaxStoredKeys,
           py::arg("max_stored_bytes") = es::kDefaultMaxStoredBytes,
           py::arg("frame_timeout_ms") = es::kFrameTimeoutMs,
           py::arg("handshake_timeout_ms") = es::kHandshakeTimeoutMs,
           py::arg("keepalive_idle_ms") = es::kKeepaliveIdleMs,
           py::arg("keepalive_interval_ms") = es::kKeepaliveIntervalMs,
           py::arg("keepalive_count") = es::kKeepaliveCount, py::arg("token") = "",
           py::arg("allow_unauthenticated_from") = std::vector<std::string>{},
           py::arg("allowed_peers") = std::vector<std::string>{}, py::arg("allow_loopback") = true,
           py::arg("barrier_idle_ms") = es::kBarrierIdleMs, py::arg("torch_protocol") = true)
      .def_property_readonly("requires_token", [](PyServer& s) { return s.get().requires_token(); })
      .def("allow_peer", [](PyServer& s, const std::string& addr) { s.get().allow_peer(addr); },
           py::arg("addr"))
      .def("set_allowed_peers",
           [](PyServer& s, const std::vector<std::string>& addrs) { s.get().set_allowed_peers(addrs); },
           py::arg("addrs"))
      .def("allowed_peers", [](PyServer& s) { return s.get().allowed_peers(); })
      .def_property_readonly("host", [](PyServer& s) { return s.get().host(); })
      .def_property_readonly("port", [](PyServer& s) { return s.get().port(); })
      .def_property_readonly("running", [](PyServer& s) { return s.get().running(); })
      .def("start", [](PyServer& s) { call_blocking([&] { s.get().start(); }); })
      .def("stop", [](PyServer& s) { call_blocking([&] { s.get().stop(); }); })
      .def("stats", [](PyServer& s) {
        auto stats = call_blocking([&] { return s.get().stats(); });
        return stats_dict(stats);
      });
}

}  // namespace elasticstore::bindings
