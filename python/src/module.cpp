// flexep._flexep: the extension module. No libtorch: tensors cross as DLPack (dlpack.h), so one
// build serves any PyTorch version and NumPy. Library errors become Python exceptions that carry the
// C++ message unchanged: ArgumentError (a ValueError), TimeoutError (the builtin TimeoutError's
// subclass) and Error (a RuntimeError).
#include "bindings.h"
#include "flexep/core/error.h"

NB_MODULE(_flexep, m) {
  namespace nb = nanobind;
  using namespace flexep::py;
  m.doc() = "flexep: MoE expert parallelism (C++/CUDA) - low-level binding; use flexep.torch";
  // Autograd graphs alive at exit (a module-level loss keeps ctx -> layer state) are not leaks.
  nb::set_leak_warnings(false);

  // Raw, never released references: the types must outlive the module (no destructor runs after
  // the interpreter has finalised).
  static PyObject* error = PyErr_NewException("flexep._flexep.Error", PyExc_RuntimeError, nullptr);
  static PyObject* arg_error = PyErr_NewExceptionWithDoc(
      "flexep._flexep.ArgumentError", "An argument or config field out of range (the message names it).",
      nb::make_tuple(nb::handle(error), nb::handle(PyExc_ValueError)).ptr(), nullptr);
  static PyObject* timeout_error = PyErr_NewExceptionWithDoc(
      "flexep._flexep.TimeoutError", "A peer rank did not arrive in time (the message names the phase).",
      nb::make_tuple(nb::handle(error), nb::handle(PyExc_TimeoutError)).ptr(), nullptr);
  m.attr("Error") = nb::handle(error);
  m.attr("ArgumentError") = nb::handle(arg_error);
  m.attr("TimeoutError") = nb::handle(timeout_error);
  // Unmatched exceptions leave the try block and reach nanobind's own translators.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const flexep::ArgumentError& e) {
      PyErr_SetString(arg_error, e.what());
    } catch (const flexep::TimeoutError& e) {
      PyErr_SetString(timeout_error, e.what());
    } catch (const flexep::Error& e) {
      PyErr_SetString(error, e.what());
    }
  });

  bind_config(m);
  bind_comm(m);
  bind_dispatcher(m);
  bind_layer(m);
  bind_moe_compute(m);
}
