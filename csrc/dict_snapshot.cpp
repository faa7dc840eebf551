#include "dict_snapshot.h"

namespace py = pybind11;

namespace fastdp {
namespace {

// Dict version fast path: CPython 3.11 and 3.12 give a dict a new ma_version_tag (PEP 509;
// deprecated by PEP 699 but still kept) on every change, so an equal tag proves the entries
// unchanged and skips their comparison; a differing one (a change, or a dict watcher's bits)
// compares them. 3.13 no longer bumps it for instance dicts backed by inline values (measured), so
// from 3.13 on every entry is compared. test_replicas_dict_snapshot_pythons.py runs the contract on
// each CPython 3.10+.
#if PY_VERSION_HEX < 0x030D0000
#define FASTDP_DICT_VERSIONS 1
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
inline uint64_t version_of(PyObject* d) {
  return reinterpret_cast<PyDictObject*>(d)->ma_version_tag;
}
#pragma GCC diagnostic pop
#else
#define FASTDP_DICT_VERSIONS 0
inline uint64_t version_of(PyObject*) { return 0; }
#endif

}  // namespace

DictSnapshot::DictSnapshot(const py::list& dicts) {
  dicts_.reserve(dicts.size());
  starts_.reserve(dicts.size() + 1);
  size_t total = 0;
  for (const auto& d : dicts) {
    if (!PyDict_Check(d.ptr())) {
      throw py::type_error("DictSnapshot takes a list of dicts");
    }
    total += 2 * static_cast<size_t>(PyDict_GET_SIZE(d.ptr()));
  }
  entries_.reserve(total);
  for (const auto& d : dicts) {
    dicts_.push_back(py::reinterpret_borrow<py::object>(d));
    versions_.push_back(version_of(d.ptr()));
    starts_.push_back(entries_.size());
    Py_ssize_t pos = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    while (PyDict_Next(d.ptr(), &pos, &key, &value)) {
      entries_.push_back(py::reinterpret_borrow<py::object>(key));
      entries_.push_back(py::reinterpret_borrow<py::object>(value));
    }
  }
  starts_.push_back(entries_.size());
}

std::vector<int64_t> DictSnapshot::changed() {
  std::vector<int64_t> out;
  for (size_t i = 0; i < dicts_.size(); ++i) {
    PyObject* d = dicts_[i].ptr();
    if (FASTDP_DICT_VERSIONS && version_of(d) == versions_[i]) {
      continue;
    }
    size_t j = starts_[i];
    const size_t end = starts_[i + 1];
    if (2 * static_cast<size_t>(PyDict_GET_SIZE(d)) != end - j) {
      out.push_back(static_cast<int64_t>(i));
      continue;
    }
    Py_ssize_t pos = 0;
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    bool same = true;
    while (same && PyDict_Next(d, &pos, &key, &value)) {
      same = key == entries_[j].ptr() && value == entries_[j + 1].ptr();
      j += 2;
    }
    if (same) {
      versions_[i] = version_of(d);  // written, same entries: the fast path again next time
    } else {
      out.push_back(static_cast<int64_t>(i));
    }
  }
  return out;
}

int DictSnapshot::traverse(visitproc visit, void* arg) const {
  for (const auto& d : dicts_) Py_VISIT(d.ptr());
  for (const auto& e : entries_) Py_VISIT(e.ptr());
  return 0;
}

void DictSnapshot::clear() {
  // Moved out first: releasing an object may run code that reaches this snapshot again.
  std::vector<py::object> dicts = std::move(dicts_);
  std::vector<py::object> entries = std::move(entries_);
  dicts_.clear();
  entries_.clear();
  versions_.clear();
  starts_.assign(1, 0);
}

void dict_snapshot_type_setup(PyHeapTypeObject* heap_type) {
  PyTypeObject* type = &heap_type->ht_type;
  type->tp_flags |= Py_TPFLAGS_HAVE_GC;
  type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) -> int {
    Py_VISIT(Py_TYPE(self));  // a heap type: its instances own a reference to it
    if (!py::detail::is_holder_constructed(self)) return 0;
    return py::cast<const DictSnapshot&>(py::handle(self)).traverse(visit, arg);
  };
  type->tp_clear = [](PyObject* self) -> int {
    if (py::detail::is_holder_constructed(self)) {
      py::cast<DictSnapshot&>(py::handle(self)).clear();
    }
    return 0;
  };
}

}  // namespace fastdp
