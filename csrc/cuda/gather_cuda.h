#pragma once
// CUDA implementation of gather_into: any tensor or the destination on a CUDA device.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastdp {

// Same contract as fastdp::gather_into (validated there). CUDA destination: sources on it and
// sources whose slice layout differs are written by one multi_copy launch (strided: any dim,
// channels_last); a source on another GPU whose slice is a dense range with its own layout is
// peer-copied straight into it (else into a temporary first); CPU sources go through Tensor.copy_.
// CPU destination: each GPU source is copied D2H into a pinned block on its device's current
// stream (all devices overlap), then into its slice once its event completed.
at::Tensor gather_cuda(const std::vector<at::Tensor>& tensors, int64_t dim, at::Device destination);

}  // namespace fastdp
