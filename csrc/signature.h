#pragma once
// Cheap change detection for persistent replicas. See NOTE [ Replica invalidation ] in
// fastdp/_snapshots.py.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastdp {

// A 64-bit hash of what persistent replicas were built from, for every tensor in order: the
// TensorImpl's identity, storage pointer and offset, sizes, strides, dtype, device, layout and
// requires_grad. Values and version counters are deliberately excluded (in-place updates are
// refreshed every step). Undefined tensors hash as a fixed marker. Touches no Python object.
uint64_t tensor_signature(const std::vector<at::Tensor>& tensors);

// How many owners hold the autograd node that produced `t` (0 for a tensor without grad_fn).
// Persistent replicas compare it with its value right after their bucket nodes were made: equal
// means no later node of any graph points at it, so no live graph can need the old values.
// See NOTE [ Persistent replicas ] in fastdp/_replica_set.py.
int64_t grad_fn_use_count(const at::Tensor& t);

}  // namespace fastdp
