#pragma once
// The key and value objects of some dicts, compared by identity later: how persistent replicas
// see that a module changed without wrapping nn.Module. See NOTE [ Replica invalidation ] in
// fastdp/_snapshots.py.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "py_hidden.h"

namespace fastdp {

class FASTDP_PY_HIDDEN DictSnapshot {
 public:
  // Holds every dict, key and value (so no address is reused while the snapshot lives).
  // Throws TypeError when an item is not a dict. Needs the GIL.
  explicit DictSnapshot(const pybind11::list& dicts);

  // Indices of the dicts that no longer hold the same key and value objects in the same order
  // (a rebinding of the object already bound is no change). Needs the GIL.
  std::vector<int64_t> changed();

  size_t size() const { return dicts_.size(); }

  // The garbage collector's view of the bound object (see dict_snapshot_type_setup): every
  // object held is visited; clear() releases them all (the snapshot then holds no dict).
  int traverse(visitproc visit, void* arg) const;
  void clear();

 private:
  std::vector<pybind11::object> dicts_;
  std::vector<uint64_t> versions_;         // the dict version fast path: dict_snapshot.cpp
  std::vector<size_t> starts_;             // dict i's entries are [starts_[i], starts_[i + 1])
  std::vector<pybind11::object> entries_;  // key, value, key, value, ...
};

// The type setup a pybind11 binding of DictSnapshot passes as py::custom_type_setup: it makes
// the type garbage-collected (tp_traverse, tp_clear). Without it, a dict's value that refers
// back to the snapshot's owner (a hook closing over it) is a cycle no collection frees.
void dict_snapshot_type_setup(PyHeapTypeObject* heap_type);

}  // namespace fastdp
