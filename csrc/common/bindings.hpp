// What the three groups' bindings share (drafting/, tree/ and kernels/bindings.cpp, made one
// module with three submodules by module.cpp): small results handed to Python as bytes or lists
// built directly, bytes arguments read as arrays, and each group's binder.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace lookupdec_bindings {

namespace nb = nanobind;

// Small results go back as bytes (the wrapper views them with np.frombuffer): creating a
// numpy array through nanobind costs an order of magnitude more than a bytes object.
template <class T>
inline nb::bytes to_bytes(const std::vector<T>& values) {
  return nb::bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}


// A bytes argument as an array of `count` T (count = -1: as many as it holds).
template <class T>
const T* bytes_array(const nb::bytes& b, int64_t* count, const char* name) {
  if (b.size() % sizeof(T) != 0 || (*count >= 0 && static_cast<int64_t>(b.size() / sizeof(T)) != *count))
    throw std::invalid_argument(std::string("merge_drafts: ") + name + " has the wrong size");
  *count = static_cast<int64_t>(b.size() / sizeof(T));
  return reinterpret_cast<const T*>(b.c_str());
}

// Python lists built directly (no numpy on the way: each list is read by Python code anyway).
inline nb::list int_list(const std::vector<int32_t>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) throw nb::python_error();
  for (size_t i = 0; i < values.size(); ++i) PyList_SET_ITEM(list, i, PyLong_FromLong(values[i]));
  return nb::steal<nb::list>(list);
}

inline nb::list float_list(const std::vector<double>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) throw nb::python_error();
  for (size_t i = 0; i < values.size(); ++i) PyList_SET_ITEM(list, i, PyFloat_FromDouble(values[i]));
  return nb::steal<nb::list>(list);
}

inline nb::list bool_list(const std::vector<uint8_t>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) throw nb::python_error();
  for (size_t i = 0; i < values.size(); ++i) PyList_SET_ITEM(list, i, Py_NewRef(values[i] ? Py_True : Py_False));
  return nb::steal<nb::list>(list);
}

// Each group's functions, classes and constants, into the module (or submodule) `m`.
void bind_drafting(nb::module_& m);
void bind_tree(nb::module_& m);
void bind_kernels(nb::module_& m);

}  // namespace lookupdec_bindings
