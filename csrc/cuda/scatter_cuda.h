#pragma once
// CUDA implementation of scatter_chunks: any leaf or destination on a CUDA device.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastdp {

// Same contract as fastdp::scatter_chunks (validated there; dims non-negative, one per leaf,
// devices.size() == number of chunks). Per destination CUDA device: pinned CPU leaves are sent by
// one async copy per chunk on its current stream; pageable ones are packed into pinned windows
// and sent on its background copy stream; leaves on another GPU are packed by one multi_copy
// launch and sent by one peer copy. Results are ordered on each destination's current stream (NOTE
// [ Stream order of host copies ]). CUDA leaves bound for the CPU are copied with Tensor.to.
std::vector<std::vector<at::Tensor>> scatter_cuda(const std::vector<at::Tensor>& leaves,
                                                  const std::vector<std::vector<int64_t>>& splits,
                                                  const std::vector<int64_t>& dims,
                                                  const std::vector<at::Device>& devices);

}  // namespace fastdp
