#pragma once
// CPU implementation of gather_into: every tensor and the destination on the CPU.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastdp {

// torch.cat(tensors, dim) computed as one allocation (torch's own output geometry, memory format
// included) plus one copy per tensor into its slice; any dim, non-contiguous and conj/neg-bit
// inputs. Tensors are copied in parallel over at::parallel_for when there are many small ones.
at::Tensor gather_cpu(const std::vector<at::Tensor>& tensors, int64_t dim);

// The slice of `out` that tensor k of a cat along `dim` lands in; undefined for empty tensors
// (torch.cat skips them). `dim` may be negative.
std::vector<at::Tensor> cat_slices(const at::Tensor& out, const std::vector<at::Tensor>& tensors,
                                   int64_t dim);

}  // namespace fastdp
