// Python interop for the bindings: error translation, GIL release with signal checks, and
// argument/result conversion. Knows nothing of torch.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "client/client.hpp"
#include "wire/log.hpp"

namespace elasticstore::py_interop {

namespace py = pybind11;
namespace es = elasticstore;

// The Python classes set by _set_error_types(). Heap-allocated and never freed: the objects must
// not be released after the interpreter is gone.
struct ErrorTypes {
  py::object store, timeout, network, compacted, authentication;
};
ErrorTypes& error_types();
// Registered with py::register_exception_translator: C++ errors to the registered classes.
void translate_exception(std::exception_ptr p);

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
extern thread_local InterruptSlot* tl_slot;
extern unsigned long g_main_thread_ident;  // set by the module init: signals go to the main thread

// The client's interrupt check for main-thread calls (see above), and whether this thread's
// call can be interrupted at all (it has a slot: other threads' waits are not sliced).
bool python_interrupt_check();
bool python_interruptible();

// Releases the GIL for a blocking call and takes it back after, unless the interpreter started
// finalizing meanwhile and this is not the thread finalizing it. Such a thread (a daemon thread
// whose call returned at exit) would be ended inside PyEval_RestoreThread by pthread_exit, whose
// forced unwind through this destructor (noexcept) aborts the process ("terminate called without
// an active exception"). It is parked instead, as Python 3.14 itself does; the process is ending.
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  ~GilRelease();
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

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
    GilRelease release;
    return f();
  } catch (const es::InterruptedError&) {
    // The GIL is held again here.
    if (slot.pending) throw py::error_already_set(std::move(*slot.pending));
    throw;
  }
}

// A str or bytes argument as bytes. bytes and str are immutable and referenced by the call's
// arguments, so the view stays valid while the GIL is released; bytearray/memoryview are copied.
std::string_view as_bytes(py::handle h, std::string& scratch, const char* what);
std::string to_string_arg(py::handle h, const char* what);
std::vector<std::string> to_string_list(py::handle seq, const char* what);
// Seconds (float) to the client's milliseconds: negative, inf or nan -> no timeout; 0 -> do not
// block; a positive timeout under 1 ms rounds up to 1 ms so it still blocks.
es::Timeout to_timeout(double seconds);
py::str decode_key(const std::string& k);
py::list key_list(const std::vector<std::string>& keys);
py::dict stats_dict(const std::vector<std::pair<std::string, uint64_t>>& stats);
es::LogLevel parse_log_level(const std::string& s);

}  // namespace elasticstore::py_interop
