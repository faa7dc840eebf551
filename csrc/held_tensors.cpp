#include "held_tensors.h"

#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <vector>

namespace fastdp {
namespace {

THPVariable* tensor_at(const pybind11::list& tensors, size_t i) {
  PyObject* obj = PyList_GET_ITEM(tensors.ptr(), static_cast<Py_ssize_t>(i));
  if (!THPVariable_Check(obj)) throw pybind11::type_error("held tensors: an item is not a tensor");
  return reinterpret_cast<THPVariable*>(obj);
}

uintptr_t data_start(const at::Tensor& t) {
  if (!t.has_storage()) return 0;
  const char* data = static_cast<const char*>(t.storage().data());
  return reinterpret_cast<uintptr_t>(data + t.storage_offset() * t.itemsize());
}

}  // namespace

pybind11::bytes held_data_ptrs(const pybind11::list& tensors) {
  std::vector<uintptr_t> out(tensors.size());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = data_start(THPVariable_Unpack(tensor_at(tensors, i)));
  }
  return pybind11::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(uintptr_t));
}

bool held_changed(const pybind11::list& tensors, const pybind11::bytes& packed) {
  char* buffer = nullptr;
  Py_ssize_t length = 0;
  if (PyBytes_AsStringAndSize(packed.ptr(), &buffer, &length) < 0) {
    throw pybind11::error_already_set();
  }
  const size_t n = static_cast<size_t>(length) / sizeof(uintptr_t);
  if (tensors.size() != n) return true;
  for (size_t i = 0; i < n; ++i) {
    uintptr_t ptr;
    std::memcpy(&ptr, buffer + i * sizeof(uintptr_t), sizeof(ptr));
    THPVariable* v = tensor_at(tensors, i);
    if (v->backward_hooks != nullptr) {
      const int hooked = PyObject_IsTrue(v->backward_hooks);
      if (hooked < 0) throw pybind11::error_already_set();
      if (hooked) return true;
    }
    if (data_start(THPVariable_Unpack(v)) != ptr) return true;
  }
  return false;
}

}  // namespace fastdp
