#pragma once
// Cheap change detection for persistent replicas. See NOTE [ Replica invalidation ] in
// fastdp/_watch.py.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastdp {

// A 64-bit hash of what persistent replicas were built from, for every tensor in order: the
// TensorImpl's identity, storage pointer and offset, sizes, strides, dtype, device, layout and
// requires_grad. Values and version counters are deliberately excluded (in-place updates are
// refreshed every step). Undefined tensors hash as a fixed marker. Touches no Python object.
uint64_t tensor_signature(const std::vector<at::Tensor>& tensors);

}  // namespace fastdp
