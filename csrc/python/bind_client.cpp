// elasticstore._C.Client and Heartbeat: the blocking client for Python (see _C.pyi). Every call
// that may touch the network or block runs with the GIL released; arguments are converted before,
// results built after.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "client/client.hpp"
#include "client/heartbeat.hpp"
#include "python/bindings.hpp"
#include "python/py_interop.hpp"
#include "wire/auth.hpp"
#include "wire/protocol.hpp"

namespace py = pybind11;
namespace es = elasticstore;
using namespace elasticstore::py_interop;

namespace elasticstore::bindings {
namespace {

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

// A timeout in seconds, negative for none (to_timeout's inverse).
double seconds_of(es::Timeout t) {
  return t.count() < 0 ? -1.0 : static_cast<double>(t.count()) / 1000.0;
}

py::object optional_bytes(const std::optional<std::string>& v) {
  if (!v) return py::none();
  return py::bytes(*v);
}

}  // namespace

void bind_client(py::module_& m) {
  py::class_<es::Client>(m, "Client")
      .def(py::init(&make_client), py::arg("host"), py::arg("port"), py::kw_only(),
           py::arg("connect_timeout") = 300.0, py::arg("timeout") = 300.0,
           py::arg("client_name") = "", py::arg("token") = "")
      .def_property_readonly("host", &es::Client::host)
      .def_property_readonly("port", &es::Client::port)
      .def_property_readonly("session_id", &es::Client::session_id)
      .def_property(
          "timeout", [](const es::Client& c) { return seconds_of(c.op_timeout()); },
          [](es::Client& c, double seconds) { c.set_op_timeout(to_timeout(seconds)); })
      .def_property(
          "connect_timeout", [](const es::Client& c) { return seconds_of(c.connect_timeout()); },
          [](es::Client& c, double seconds) { c.set_connect_timeout(to_timeout(seconds)); })
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

}  // namespace elasticstore::bindings
