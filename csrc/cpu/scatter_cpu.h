#pragma once
// CPU implementation of scatter_chunks: every leaf and every destination on the CPU.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastdp {

// result[r][i] = leaves[i].narrow(dims[i], offset, splits[i][r]): a view of the leaf, no copy (as
// torch: split then .to('cpu') of a CPU tensor returns the view itself). dims are non-negative,
// splits are validated by the caller (fastdp::scatter_chunks).
std::vector<std::vector<at::Tensor>> scatter_cpu(const std::vector<at::Tensor>& leaves,
                                                 const std::vector<std::vector<int64_t>>& splits,
                                                 const std::vector<int64_t>& dims);

// The view of chunk `r` of `leaf` (the building block shared with the CUDA implementation).
at::Tensor chunk_view(const at::Tensor& leaf, int64_t dim, const std::vector<int64_t>& sizes,
                      const std::vector<int64_t>& offsets, size_t r);

}  // namespace fastdp
