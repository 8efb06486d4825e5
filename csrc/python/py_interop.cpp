#include "python/py_interop.hpp"

#include <unistd.h>

#include <cmath>
#include <system_error>

namespace elasticstore::py_interop {


// ---- error types ------------------------------------------------------------------------------
ErrorTypes& error_types() {
  static ErrorTypes* types = new ErrorTypes();
  return *types;
}

namespace {
void raise_as(const py::object& cls, PyObject* fallback, const char* what) {
  PyErr_SetString(cls ? cls.ptr() : fallback, what);
}
}  // namespace

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
  } catch (const es::AuthenticationError& e) {
    const ErrorTypes& t = error_types();
    raise_as(t.authentication ? t.authentication : t.store, PyExc_PermissionError, e.what());
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

// ---- GIL release (see py_interop.hpp) --------------------------------------------------------
namespace {
bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}
}  // namespace

GilRelease::~GilRelease() {
  if (interpreter_finalizing() && PyThread_get_thread_ident() != g_main_thread_ident) {
    for (;;) ::pause();  // never returns: exit() ends the process with this thread in it
  }
  PyEval_RestoreThread(state_);
}

// ---- interrupts (see py_interop.hpp) ---------------------------------------------------------
thread_local InterruptSlot* tl_slot = nullptr;
unsigned long g_main_thread_ident = 0;

bool python_interruptible() { return tl_slot != nullptr; }

bool python_interrupt_check() {
  InterruptSlot* slot = tl_slot;
  if (slot == nullptr) return false;
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  slot->pending.emplace();  // fetches (and clears) the exception a handler raised
  return true;
}

// ---- argument conversion ----------------------------------------------------------------------
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

}  // namespace elasticstore::py_interop
