#pragma once
// CUDA backend of the coalesced broadcast / reduce-add (csrc/comm.h): one grouped NCCL call when the
// devices are distinct, device-to-device copies (and adds) when ids repeat or NCCL is missing.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "comm_buckets.h"

namespace fastdp {

// For every destination k and bucket b: dsts[k][b] (contiguous 1-D on dst_devices[k], b.numel
// elements of b.dtype) receives bucket b of `srcs` (contiguous, on src_device), bit for bit. Packs
// each bucket once on src_device's current stream; then NCCL broadcast (src + destinations all
// distinct) or copy_ per bucket and destination (ATen orders the streams of cross-device copies).
// Asynchronous: ready in order on each destination's current stream.
void broadcast_flat_cuda(at::TensorList srcs, at::Device src_device,
                         const std::vector<Bucket>& buckets,
                         const std::vector<at::Device>& dst_devices,
                         const std::vector<std::vector<at::Tensor>>& dsts, const char* op);

// For each bucket b of inputs[0]'s list: a fresh flat tensor on devices[root] holding, per tensor,
// the sum over the (at least two) input lists (inputs[i] contiguous, on devices[i]). NCCL reduce
// when the devices are distinct and NCCL sums the dtype (NCCL's order); otherwise list order,
// x0 + x1 + ..., copied to the root device non-blocking. Asynchronous, on the current streams.
std::vector<at::Tensor> reduce_flat_cuda(const std::vector<std::vector<at::Tensor>>& inputs,
                                         const std::vector<at::Device>& devices, int64_t root,
                                         const std::vector<Bucket>& buckets, const char* op);

}  // namespace fastdp
