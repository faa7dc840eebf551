#pragma once
// Fused chunked scatter of every input leaf of one step to the replicas' devices.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastdp {

// result[r][i] is chunk r of leaves[i] on devices[r]: plan[i][r] slices along dims[i] (dims holds
// one dim per leaf, or one for all; negative ones are normalised per leaf), equal to
// leaves[i].split(plan[i], dims[i])[r].to(devices[r]) in values, sizes, strides and dtype.
// A chunk whose device is its leaf's device is a view of the leaf (as torch); the others are views
// into one fresh buffer per destination and source device (regions kRegionAlign-aligned, shared
// storage). CUDA leaves must be ready on their device's current stream; CUDA results are ready on
// each destination's current stream (no host sync). Every plan row has the same R <=
// devices.size() entries; the result has R lists. Results carry no autograd history.
std::vector<std::vector<at::Tensor>> scatter_chunks(const std::vector<at::Tensor>& leaves,
                                                    const std::vector<std::vector<int64_t>>& plan,
                                                    const std::vector<int64_t>& dims,
                                                    const std::vector<at::Device>& devices);

}  // namespace fastdp
