// elasticstore._C: the native Server and Client for Python (pybind11). Knows nothing of torch.
// The API is python/elasticstore/_C.pyi. The module's constants, the op table and call statistics
// are here; the Server is bound in bind_server.cpp, the Client and Heartbeat in bind_client.cpp.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "client/stats.hpp"
#include "python/bindings.hpp"
#include "python/py_interop.hpp"
#include "wire/auth.hpp"
#include "wire/protocol.hpp"

namespace py = pybind11;
namespace es = elasticstore;
using namespace elasticstore::py_interop;

namespace {

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

// ops.def as (call name, opcode, kind) rows, in opcode order (see OPS in _C.pyi).
py::tuple op_table() {
  py::list rows;
  for (const es::OpInfo& op : es::kOps) {
    rows.append(py::make_tuple(op.call_name, static_cast<int>(op.op), es::op_kind_name(op.kind)));
  }
  return py::tuple(rows);
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
  m.attr("OPS") = op_table();
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

  es::bindings::bind_server(m);
  es::bindings::bind_client(m);
}
