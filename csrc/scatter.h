#pragma once
// Fused chunked scatter of every input leaf of one step to the replicas' devices.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastdp {

// result[r][i] is chunk r of leaves[i] on devices[r]: splits[i][r] slices along dims[i] (dims holds
// one dim per leaf, or one for all; negative ones are normalised per leaf), equal to
// leaves[i].split(splits[i], dims[i])[r].to(devices[r]) in values, sizes, strides and dtype.
// A chunk whose device is its leaf's device is a view of the leaf (as torch); the others are views
// into one fresh buffer per destination and source device (regions kRegionAlign-aligned, shared
// storage). CUDA leaves must be ready on their device's current stream; CUDA results are ready on
// each destination's current stream (no host sync). Every leaf's split has the same R <=
// devices.size() entries; the result has R lists. Results carry no autograd history.
std::vector<std::vector<at::Tensor>> scatter_chunks(const std::vector<at::Tensor>& leaves,
                                                    const std::vector<std::vector<int64_t>>& splits,
                                                    const std::vector<int64_t>& dims,
                                                    const std::vector<at::Device>& devices);

// For each chunk (a tensor, usually a view of a leaf), a view of the same sizes, strides and
// storage offset whose base is a fresh alias of the chunk's base (the chunk itself if it is no
// view): same storage, no autograd history, and a version counter of its own shared with no other
// result, so an in-place write through one bumps no other tensor's version. See NOTE [ Input
// chunks written in place ] in fastdp/scatter_gather.py.
std::vector<at::Tensor> own_version_views(const std::vector<at::Tensor>& chunks);

// The scatter of leaves that all stay on their device, replica-major: result[r * n + i] is chunk r
// of leaves[i] (n leaves; splits[i][r] rows along dims[i], negative dims wrapped), the view
// leaves[i].split_with_sizes(splits[i], dims[i])[r]. Chunks 1.. of a leaf that neither requires
// grad nor is an inference, conj or neg tensor get a version counter of their own (shared with no
// other tensor), so a write through one bumps no other tensor's version; chunk 0 keeps the
// leaf's. See NOTE [ Input chunks written in place ] in fastdp/scatter_gather.py.
std::vector<at::Tensor> split_own_versions(const std::vector<at::Tensor>& leaves,
                                           const std::vector<std::vector<int64_t>>& splits,
                                           const std::vector<int64_t>& dims);

}  // namespace fastdp
