// stepcore._core.diff_compare: the library's comparer (stepcore/diff.hpp) for stepcore.diff,
// thin: the paths and options go to compare_json, which returns the comparison as JSON
// text (the schema of stepcore-diff --json plus what the report draws); the GIL is
// released while the files are read and compared. A bad input raises
// _core.DiffInputError (a ValueError) naming the file; A and B of different kinds raise
// ValueError. Built without nlohmann-json (STEPCORE_PY_DIFF unset) it is absent.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#ifdef STEPCORE_PY_DIFF
#include "stepcore/diff.hpp"
#endif

namespace nb = nanobind;

void bind_diff(nb::module_& m) {
#ifdef STEPCORE_PY_DIFF
  // The messages name files, whose names (and a corrupt header's bytes) need not be UTF-8.
  static PyObject* input_error =
      PyErr_NewException("stepcore._core.DiffInputError", PyExc_ValueError, nullptr);
  m.attr("DiffInputError") = nb::handle(input_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    const auto raise = [](PyObject* type, const char* what) {
      PyObject* msg = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)),
                                           "backslashreplace");
      PyErr_SetObject(type, msg);
      Py_XDECREF(msg);
    };
    try {
      std::rethrow_exception(p);
    } catch (const stepcore::diff::InputError& e) {
      raise(input_error, e.what());
    } catch (const stepcore::diff::UsageError& e) {
      raise(PyExc_ValueError, e.what());
    }
  });
  m.def(
      "diff_compare",
      [](const std::string& a, const std::string& b, std::optional<std::uint64_t> max_ulps,
         int threads, bool all) {
        nb::gil_scoped_release released;
        return stepcore::diff::compare_json(a, b, max_ulps, threads, all);
      },
      nb::arg("a"), nb::arg("b"), nb::arg("max_ulps").none() = nb::none(), nb::arg("threads") = 0,
      nb::arg("all") = false,
      "Private (stepcore.diff): compares the recordings or safetensors files `a` and `b` with "
      "stepcore-diff's comparer; returns JSON text {kind, runs, result, details, human} "
      "(human: stepcore-diff's table and summary, every tensor listed with `all`).");
#else
  (void)m;
#endif
}
