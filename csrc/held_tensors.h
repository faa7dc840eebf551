#pragma once
// The per-step check of the tensors persistent replicas hold: NOTE [ Tensors a forward changed ]
// in fastdp/_replica_set.py. One pass in C over a list of Python tensors, with the GIL held.

#include <pybind11/pybind11.h>

namespace fastdp {

// Where each tensor's data starts (storage data plus offset; 0 without storage), packed in
// bytes, read without materializing a copy-on-write storage. TypeError for a non-tensor item.
pybind11::bytes held_data_ptrs(const pybind11::list& tensors);

// Whether any tensor's data moved from `ptrs` (held_data_ptrs of the same list) or any has a
// truthy `_backward_hooks` (a hook registered on it); a list of another length has changed.
// TypeError for an item that is not a tensor.
bool held_changed(const pybind11::list& tensors, const pybind11::bytes& ptrs);

}  // namespace fastdp
