#pragma once
// Gather of the replicas' outputs into one tensor on the output device.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastdp {

// Equals torch.cat([t.to(destination) for t in tensors], dim) in values, sizes, strides and dtype:
// the output is allocated once on `destination` and every tensor is copied straight into its slice.
// All tensors share one dtype; CUDA tensors are ready on their device's current stream. For a CUDA
// destination the result is ready on its current stream (no device-wide sync); for a CPU
// destination it is complete on return. No autograd history.
at::Tensor gather_into(const std::vector<at::Tensor>& tensors, int64_t dim, at::Device destination);

}  // namespace fastdp
