#pragma once
// CUDA implementation of scatter_chunks: any leaf or destination on a CUDA device.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastdp {

// Same contract as fastdp::scatter_chunks (validated there; dims non-negative, one per leaf,
// devices.size() == number of chunks). Per destination CUDA device: CPU leaves are packed into
// pinned staging blocks and sent by one async H2D (pipelined in windows when large) on the device's
// background copy stream; leaves on another GPU are packed by one multi_copy launch on their
// device's current stream and sent by one peer copy. The destination's current stream waits on
// events for both. CUDA leaves bound for the CPU are copied with Tensor.to (synchronous).
std::vector<std::vector<at::Tensor>> scatter_cuda(const std::vector<at::Tensor>& leaves,
                                                  const std::vector<std::vector<int64_t>>& plan,
                                                  const std::vector<int64_t>& dims,
                                                  const std::vector<at::Device>& devices);

}  // namespace fastdp
