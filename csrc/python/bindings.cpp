// elasticstore._C: the native Server and Client for Python (pybind11). Knows nothing of torch.
// The API is python/elasticstore/_C.pyi. Every call that may touch the network or block runs with
// the GIL released; arguments are converted before, results built after.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "wire/auth.hpp"
#include "client/client.hpp"
#include "client/heartbeat.hpp"
#include "client/stats.hpp"
#include "wire/protocol.hpp"
#include "python/py_interop.hpp"
#include "server/server.hpp"

namespace py = pybind11;
namespace es = elasticstore;
using namespace elasticstore::py_interop;

namespace {

// ---- Server -----------------------------------------------------------------------------------
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

// ---- Client -----------------------------------------------------------------------------------
std::unique_ptr<es::Client> make_client(const std::string& host, int port, double connect_timeout,
                                        double timeout, const std::string& client_name,
                                        const std::string& token) {
  if (port < 0 || port > 65535) throw py::value_error("port must be in [0, 65535]");
  es::ClientOptions options;
  options.connect_timeout = to_timeout(connect_timeout);
  options.op_timeout = to_timeout(timeout);
  options.client_name = client_name;
  if (!token.empty() && !es::token_problem(token).empty())
    throw py::value_error(es::token_problem(token));
  options.token = token;
  options.interrupt_check = python_interrupt_check;
  options.interruptible = python_interruptible;
  return call_blocking(
      [&] { return std::make_unique<es::Client>(host, static_cast<uint16_t>(port), options); });
}

// call_stats::snapshot() as plain Python objects (see client_call_stats in _C.pyi).
py::list client_call_stats() {
  namespace cs = es::call_stats;
  const std::vector<cs::OpSnapshot> snap = cs::snapshot();
  py::list out;
  for (const cs::OpSnapshot& s : snap) {
    py::dict calls;
    for (std::size_t o = 0; o < cs::kOutcomes; ++o) {
      calls[cs::outcome_name(static_cast<cs::Outcome>(o))] = s.calls[o];
    }
    py::list buckets;
    for (const uint64_t n : s.buckets) buckets.append(n);
    py::dict d;
    d["op"] = s.op;
    d["calls"] = calls;
    d["seconds"] = static_cast<double>(s.total_ns) / 1e9;
    d["buckets"] = buckets;
    out.append(d);
  }
  return out;
}

py::object optional_bytes(const std::optional<std::string>& v) {
  if (!v) return py::none();
  return py::bytes(*v);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "elasticstore native extension: the TCP store Server and Client (see _C.pyi)";
  g_main_thread_ident = PyThread_get_thread_ident();
  {
    // The import may run on another thread; signals are handled by threading.main_thread().
    py::object main = py::module_::import("threading").attr("main_thread")();
    py::object ident = main.attr("ident");
    if (!ident.is_none()) g_main_thread_ident = ident.cast<unsigned long>();
  }

  m.attr("__version__") = ELASTICSTORE_VERSION;
  m.attr("PROTOCOL_VERSION") = es::kProtocolVersion;
  m.attr("MAX_KEY_BYTES") = es::kMaxKeyBytes;
  m.attr("MAX_VALUE_BYTES") = es::kMaxValueBytes;
  m.attr("MAX_KEYS_PER_REQUEST") = es::kMaxKeysPerRequest;
  m.attr("NO_TIMEOUT") = -1.0;
  m.attr("MAX_TOKEN_BYTES") = es::kMaxTokenBytes;
  {
    namespace cs = es::call_stats;
    py::list bounds;
    for (const int64_t ns : cs::kLatencyBoundsNs) bounds.append(static_cast<double>(ns) / 1e9);
    m.attr("CLIENT_CALL_BUCKETS") = py::tuple(bounds);
    py::list outcomes;
    for (std::size_t o = 0; o < cs::kOutcomes; ++o)
      outcomes.append(cs::outcome_name(static_cast<cs::Outcome>(o)));
    m.attr("CLIENT_CALL_OUTCOMES") = py::tuple(outcomes);
  }
  m.def("client_call_stats", &client_call_stats,
        "Calls of every Client of this process so far, per operation (see _C.pyi)");

  py::register_exception_translator(translate_exception);

  m.def(
      "_set_error_types",
      [](py::object store, py::object timeout, py::object network, py::object compacted,
         py::object authentication) {
        for (const py::object* cls : {&store, &timeout, &network, &compacted}) {
          if (!PyExceptionClass_Check(cls->ptr())) {
            throw py::type_error("_set_error_types expects exception classes");
          }
        }
        ErrorTypes& t = error_types();
        t.store = std::move(store);
        t.timeout = std::move(timeout);
        t.network = std::move(network);
        t.compacted = std::move(compacted);
        if (!authentication.is_none()) {
          if (!PyExceptionClass_Check(authentication.ptr()))
            throw py::type_error("_set_error_types expects exception classes");
          t.authentication = std::move(authentication);
        }
      },
      py::kw_only(), py::arg("store"), py::arg("timeout"), py::arg("network"),
      py::arg("compacted"), py::arg("authentication") = py::none());

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

  py::class_<es::Client>(m, "Client")
      .def(py::init(&make_client), py::arg("host"), py::arg("port"), py::kw_only(),
           py::arg("connect_timeout") = 300.0, py::arg("timeout") = 300.0,
           py::arg("client_name") = "", py::arg("token") = "")
      .def_property_readonly("host", &es::Client::host)
      .def_property_readonly("port", &es::Client::port)
      .def_property_readonly("session_id", &es::Client::session_id)
      .def_property(
          "timeout",
          [](const es::Client& c) {
            const auto t = c.op_timeout();
            return t.count() < 0 ? -1.0 : static_cast<double>(t.count()) / 1000.0;
          },
          [](es::Client& c, double seconds) { c.set_op_timeout(to_timeout(seconds)); })
      .def("clone", [](es::Client& c) { return call_blocking([&] { return c.clone(); }); })
      .def("close", [](es::Client& c) { call_blocking([&] { c.close(); }); })
      .def(
          "set",
          [](es::Client& c, py::handle key, py::handle value, bool ephemeral) {
            std::string ks, vs;
            auto k = as_bytes(key, ks, "key");
            auto v = as_bytes(value, vs, "value");
            return call_blocking([&] { return c.set(k, v, ephemeral); });
          },
          py::arg("key"), py::arg("value"), py::arg("ephemeral") = false)
      .def(
          "get",
          [](es::Client& c, py::handle key, double timeout) {
            std::string ks;
            auto k = as_bytes(key, ks, "key");
            std::string v = call_blocking([&] { return c.get(k, to_timeout(timeout)); });
            return py::bytes(v);
          },
          py::arg("key"), py::arg("timeout"))
      .def(
          "try_get",
          [](es::Client& c, py::handle key) -> py::object {
            std::string ks;
            auto k = as_bytes(key, ks, "key");
            auto r = call_blocking([&] { return c.try_get(k); });
            if (!r) return py::none();
            return py::make_tuple(py::bytes(r->first), r->second);
          },
          py::arg("key"))
      .def(
          "add",
          [](es::Client& c, py::handle key, int64_t delta) {
            std::string ks;
            auto k = as_bytes(key, ks, "key");
            return call_blocking([&] { return c.add(k, delta); });
          },
          py::arg("key"), py::arg("delta"))
      .def(
          "compare_set",
          [](es::Client& c, py::handle key, py::handle expected, py::handle desired,
             bool ephemeral) {
            std::string ks, es_, ds;
            auto k = as_bytes(key, ks, "key");
            auto e = as_bytes(expected, es_, "expected");
            auto d = as_bytes(desired, ds, "desired");
            auto r = call_blocking([&] { return c.compare_set(k, e, d, ephemeral); });
            return py::make_tuple(r.swapped, r.exists ? py::object(py::bytes(r.current))
                                                      : py::object(py::none()));
          },
          py::arg("key"), py::arg("expected"), py::arg("desired"), py::arg("ephemeral") = false)
      .def(
          "wait",
          [](es::Client& c, py::handle keys, double timeout) {
            auto ks = to_string_list(keys, "keys");
            call_blocking([&] { c.wait(ks, to_timeout(timeout)); });
          },
          py::arg("keys"), py::arg("timeout"))
      .def(
          "check",
          [](es::Client& c, py::handle keys) {
            auto ks = to_string_list(keys, "keys");
            return call_blocking([&] { return c.check(ks); });
          },
          py::arg("keys"))
      .def(
          "delete_key",
          [](es::Client& c, py::handle key) {
            std::string ks;
            auto k = as_bytes(key, ks, "key");
            return call_blocking([&] { return c.delete_key(k); });
          },
          py::arg("key"))
      .def("num_keys", [](es::Client& c) { return call_blocking([&] { return c.num_keys(); }); })
      .def(
          "list_keys",
          [](es::Client& c, py::handle prefix) {
            std::string ps;
            auto p = as_bytes(prefix, ps, "prefix");
            auto keys = call_blocking([&] { return c.list_keys(p); });
            return key_list(keys);
          },
          py::arg("prefix") = "")
      .def(
          "append",
          [](es::Client& c, py::handle key, py::handle value) {
            std::string ks, vs;
            auto k = as_bytes(key, ks, "key");
            auto v = as_bytes(value, vs, "value");
            return call_blocking([&] { return c.append(k, v); });
          },
          py::arg("key"), py::arg("value"))
      .def(
          "multi_get",
          [](es::Client& c, py::handle keys, double timeout) {
            auto ks = to_string_list(keys, "keys");
            auto values = call_blocking([&] { return c.multi_get(ks, to_timeout(timeout)); });
            py::list out(values.size());
            for (std::size_t i = 0; i < values.size(); ++i) out[i] = py::bytes(values[i]);
            return out;
          },
          py::arg("keys"), py::arg("timeout"))
      .def(
          "multi_set",
          [](es::Client& c, py::handle keys, py::handle values) {
            auto ks = to_string_list(keys, "keys");
            auto vs = to_string_list(values, "values");
            return call_blocking([&] { return c.multi_set(ks, vs); });
          },
          py::arg("keys"), py::arg("values"))
      .def(
          "queue_push",
          [](es::Client& c, py::handle queue, py::handle value) {
            std::string qs, vs;
            auto q = as_bytes(queue, qs, "queue");
            auto v = as_bytes(value, vs, "value");
            return call_blocking([&] { return c.queue_push(q, v); });
          },
          py::arg("queue"), py::arg("value"))
      .def(
          "queue_pop",
          [](es::Client& c, py::handle queue, double timeout) {
            std::string qs;
            auto q = as_bytes(queue, qs, "queue");
            auto v = call_blocking([&] { return c.queue_pop(q, to_timeout(timeout)); });
            return optional_bytes(v);
          },
          py::arg("queue"), py::arg("timeout"))
      .def(
          "queue_len",
          [](es::Client& c, py::handle queue) {
            std::string qs;
            auto q = as_bytes(queue, qs, "queue");
            return call_blocking([&] { return c.queue_len(q); });
          },
          py::arg("queue"))
      .def("ping", [](es::Client& c) { call_blocking([&] { c.ping(); }); })
      .def(
          "allow_peers",
          [](es::Client& c, const std::vector<std::string>& addrs) {
            call_blocking([&] { c.allow_peers(addrs); });
          },
          py::arg("addrs"))
      .def(
          "barrier",
          [](es::Client& c, py::handle key, int64_t world_size, double timeout) {
            std::string ks;
            auto k = as_bytes(key, ks, "key");
            return call_blocking([&] { return c.barrier(k, world_size, to_timeout(timeout)); });
          },
          py::arg("key"), py::arg("world_size"), py::arg("timeout"))
      .def(
          "watch",
          [](es::Client& c, py::handle key, std::optional<uint64_t> after_revision,
             double timeout, bool prefix) {
            std::string ks;
            auto k = as_bytes(key, ks, "key");
            auto ev = call_blocking(
                [&] { return c.watch(k, after_revision, to_timeout(timeout), prefix); });
            const char* kind = ev.kind == es::EventKind::Set ? "set" : "delete";
            return py::make_tuple(kind, decode_key(ev.key), py::bytes(ev.value), ev.revision);
          },
          py::arg("key"), py::arg("after_revision"), py::arg("timeout"),
          py::arg("prefix") = false)
      .def("stats", [](es::Client& c) {
        auto stats = call_blocking([&] { return c.stats(); });
        return stats_dict(stats);
      });

  py::class_<es::Heartbeat>(m, "Heartbeat")
      .def(py::init([](es::Client& client, const std::string& key, const std::string& value,
                       double period, const std::string& presence) {
             return call_blocking([&] {
               return std::make_unique<es::Heartbeat>(client.clone(), key, value,
                                                      to_timeout(period), presence);
             });
           }),
           py::arg("client"), py::arg("key"), py::arg("value"), py::arg("period"),
           py::arg("presence") = "")
      .def("beat", [](es::Heartbeat& h) { call_blocking([&] { h.beat(); }); })
      .def_property_readonly("beats", &es::Heartbeat::beats)
      .def("stop", [](es::Heartbeat& h) {
        py::gil_scoped_release release;
        h.stop();
      });
}
