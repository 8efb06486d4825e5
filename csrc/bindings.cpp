// elasticstore._C: the native Server and Client for Python (pybind11). Knows nothing of torch.
// The API is python/elasticstore/_C.pyi. Every call that may touch the network or block runs with
// the GIL released; arguments are converted before, results built after.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "client.hpp"
#include "log.hpp"
#include "protocol.hpp"
#include "server.hpp"

namespace py = pybind11;
namespace es = elasticstore;

namespace {

// ---- error types ------------------------------------------------------------------------------
// The Python classes set by _set_error_types(). Heap-allocated and never freed: the objects must
// not be released after the interpreter is gone.
struct ErrorTypes {
  py::object store, timeout, network, compacted;
};
ErrorTypes& error_types() {
  static ErrorTypes* types = new ErrorTypes();
  return *types;
}

void raise_as(const py::object& cls, PyObject* fallback, const char* what) {
  PyErr_SetString(cls ? cls.ptr() : fallback, what);
}

void translate_exception(std::exception_ptr p) {
  if (!p) return;
  try {
    std::rethrow_exception(p);
  } catch (const es::CompactedError& e) {
    const ErrorTypes& t = error_types();
    if (!t.compacted) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return;
    }
    try {
      py::object exc = t.compacted(e.what(), e.oldest_revision());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    } catch (py::error_already_set& err) {
      err.restore();
    }
  } catch (const es::TimeoutError& e) {
    raise_as(error_types().timeout, PyExc_TimeoutError, e.what());
  } catch (const es::NetworkError& e) {
    raise_as(error_types().network, PyExc_ConnectionError, e.what());
  } catch (const es::InterruptedError& e) {
    // The Python exception raised by a signal handler is re-raised by call_blocking(); this is
    // reached only when no Python exception was pending (a C++-level interrupt).
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
  } catch (const es::StoreError& e) {
    raise_as(error_types().store, PyExc_RuntimeError, e.what());
  } catch (const std::system_error& e) {
    // The server's bind/listen failures: OSError(errno, message) like the socket module.
    if (e.code().category() == std::system_category() ||
        e.code().category() == std::generic_category()) {
      try {
        py::object exc =
            py::reinterpret_borrow<py::object>(PyExc_OSError)(e.code().value(), e.what());
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      } catch (py::error_already_set& err) {
        err.restore();
      }
    } else {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  }
}

// ---- interrupts -------------------------------------------------------------------------------
// Signals are handled by Python on the main thread only. While a main-thread call waits with the
// GIL released, the client polls python_interrupt_check() every <=100 ms: it takes the GIL and runs
// the pending signal handlers (PyErr_CheckSignals). When a handler raised (KeyboardInterrupt from
// SIGINT, or whatever a custom handler raises), the exception is moved out of the thread state
// into the call's slot and the check returns true; the client closes its connection and throws
// InterruptedError, which call_blocking() catches after the GIL is back and turns into the saved
// Python exception. Other threads never take the GIL in the check (they have no slot).
struct InterruptSlot {
  std::optional<py::error_already_set> pending;
};
thread_local InterruptSlot* tl_slot = nullptr;
unsigned long g_main_thread_ident = 0;

bool python_interrupt_check() {
  InterruptSlot* slot = tl_slot;
  if (slot == nullptr) return false;
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  slot->pending.emplace();  // fetches (and clears) the exception a handler raised
  return true;
}

template <typename F>
auto call_blocking(F&& f) -> decltype(f()) {
  InterruptSlot slot;
  const bool main_thread = PyThread_get_thread_ident() == g_main_thread_ident;
  struct SlotScope {
    explicit SlotScope(InterruptSlot* s) : prev(tl_slot) { tl_slot = s; }
    ~SlotScope() { tl_slot = prev; }
    InterruptSlot* prev;
  } scope(main_thread ? &slot : nullptr);
  try {
    py::gil_scoped_release release;
    return f();
  } catch (const es::InterruptedError&) {
    // The GIL is held again here.
    if (slot.pending) throw py::error_already_set(std::move(*slot.pending));
    throw;
  }
}

// ---- argument conversion ----------------------------------------------------------------------
// A str or bytes argument as bytes. bytes and str are immutable and referenced by the call's
// arguments, so the view stays valid while the GIL is released; bytearray/memoryview are copied.
std::string_view as_bytes(py::handle h, std::string& scratch, const char* what) {
  PyObject* o = h.ptr();
  if (PyBytes_Check(o)) {
    return {PyBytes_AS_STRING(o), static_cast<std::size_t>(PyBytes_GET_SIZE(o))};
  }
  if (PyUnicode_Check(o)) {
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(o, &n);
    if (!s) throw py::error_already_set();
    return {s, static_cast<std::size_t>(n)};
  }
  if (PyByteArray_Check(o) || PyMemoryView_Check(o)) {
    PyObject* b = PyBytes_FromObject(o);
    if (!b) throw py::error_already_set();
    scratch.assign(PyBytes_AS_STRING(b), static_cast<std::size_t>(PyBytes_GET_SIZE(b)));
    Py_DECREF(b);
    return scratch;
  }
  throw py::type_error(std::string(what) + " must be str or bytes, not " +
                       Py_TYPE(o)->tp_name);
}

std::string to_string_arg(py::handle h, const char* what) {
  std::string scratch;
  std::string_view v = as_bytes(h, scratch, what);
  return scratch.empty() ? std::string(v) : std::move(scratch);
}

std::vector<std::string> to_string_list(py::handle seq, const char* what) {
  if (PyUnicode_Check(seq.ptr()) || PyBytes_Check(seq.ptr()) || PyByteArray_Check(seq.ptr())) {
    throw py::type_error(std::string(what) + " must be a list of str or bytes, not a single " +
                         Py_TYPE(seq.ptr())->tp_name);
  }
  std::vector<std::string> out;
  if (PyList_Check(seq.ptr()) || PyTuple_Check(seq.ptr())) out.reserve(py::len(seq));
  for (py::handle item : py::iter(seq)) out.push_back(to_string_arg(item, what));
  return out;
}

// Seconds (float) to the client's milliseconds: negative, inf or nan -> no timeout; 0 -> do not
// block; a positive timeout under 1 ms rounds up to 1 ms so it still blocks.
es::Timeout to_timeout(double seconds) {
  if (std::isnan(seconds) || seconds < 0 || std::isinf(seconds)) return es::kForever;
  const double ms = std::ceil(seconds * 1000.0);
  if (ms >= 1e15) return es::Timeout(static_cast<int64_t>(1e15));  // the client clamps
  return es::Timeout(static_cast<int64_t>(ms));
}

py::str decode_key(const std::string& k) {
  PyObject* s =
      PyUnicode_DecodeUTF8(k.data(), static_cast<Py_ssize_t>(k.size()), "surrogateescape");
  if (!s) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(s);
}

py::list key_list(const std::vector<std::string>& keys) {
  py::list out(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) out[i] = decode_key(keys[i]);
  return out;
}

py::dict stats_dict(const std::vector<std::pair<std::string, uint64_t>>& stats) {
  py::dict d;
  for (const auto& [name, value] : stats) d[decode_key(name)] = py::int_(value);
  return d;
}

es::LogLevel parse_log_level(const std::string& s) {
  if (s == "debug") return es::LogLevel::Debug;
  if (s == "info") return es::LogLevel::Info;
  if (s == "warning") return es::LogLevel::Warning;
  if (s == "error") return es::LogLevel::Error;
  if (s == "off") return es::LogLevel::Off;
  throw py::value_error(
      "log_level must be one of 'debug', 'info', 'warning', 'error', 'off', not '" + s + "'");
}

// ---- Server -----------------------------------------------------------------------------------
class PyServer {
 public:
  PyServer(const std::string& host, int port, int backlog, std::size_t max_connections,
           const std::string& log_level) {
    if (port < 0 || port > 65535) throw py::value_error("port must be in [0, 65535]");
    es::ServerConfig config;
    config.host = host;
    config.port = static_cast<uint16_t>(port);
    config.backlog = backlog;
    config.max_connections = max_connections;
    config.log_level = parse_log_level(log_level);
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
                                        const std::string& client_name) {
  if (port < 0 || port > 65535) throw py::value_error("port must be in [0, 65535]");
  es::ClientOptions options;
  options.connect_timeout = to_timeout(connect_timeout);
  options.client_name = client_name;
  options.interrupt_check = python_interrupt_check;
  return call_blocking(
      [&] { return std::make_unique<es::Client>(host, static_cast<uint16_t>(port), options); });
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

  py::register_exception_translator(translate_exception);

  m.def(
      "_set_error_types",
      [](py::object store, py::object timeout, py::object network, py::object compacted) {
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
      },
      py::kw_only(), py::arg("store"), py::arg("timeout"), py::arg("network"),
      py::arg("compacted"));

  py::class_<PyServer>(m, "Server")
      .def(py::init<const std::string&, int, int, std::size_t, const std::string&>(),
           py::arg("host") = "127.0.0.1", py::arg("port") = 0, py::kw_only(),
           py::arg("backlog") = 0, py::arg("max_connections") = es::kDefaultMaxConnections,
           py::arg("log_level") = "warning")
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
           py::arg("connect_timeout") = 300.0, py::arg("client_name") = "")
      .def_property_readonly("host", &es::Client::host)
      .def_property_readonly("port", &es::Client::port)
      .def_property_readonly("session_id", &es::Client::session_id)
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
}
