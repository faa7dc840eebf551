#pragma once
// CPU backend of the coalesced broadcast / reduce-add (csrc/comm.h): CPU "devices" are virtual
// replicas in host memory, so both are plain multi-threaded memory passes (at::parallel_for).

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "comm_buckets.h"

namespace fastdp {

// For every destination k and bucket b: copies the tensors of bucket b from `srcs` (contiguous, no
// conj/neg bit) into dsts[k][b] (contiguous 1-D, b.numel elements of b.dtype) at the bucket's
// offsets. One parallel pass over all bytes of all destinations; bit-exact for every dtype.
// dsts must not overlap srcs. Synchronous: done on return.
void broadcast_flat_cpu(at::TensorList srcs, const std::vector<Bucket>& buckets,
                        const std::vector<std::vector<at::Tensor>>& dsts);

// broadcast_coalesced_into on the CPU: srcs[j] into outs[k][j] for every k and j whose out is
// flat_copyable, in one parallel memcpy pass (no bucketing needed: host pointers are enough).
// Returns the (k, j) of the other outs (strided, conj/neg views), left for the caller to copy_.
std::vector<std::pair<size_t, size_t>> copy_into_cpu(
    at::TensorList srcs, const std::vector<std::vector<at::Tensor>>& outs);

// For each bucket b of inputs[0]'s list: a fresh flat CPU tensor whose segment for tensor j is
// inputs[0][j] + inputs[1][j] + ... in list order, rounded to the dtype after each add (bit-identical
// to torch's `x0 + x1`, then `add_` of the rest). At least two input lists, contiguous, equal dtypes
// and sizes per position. Dtypes: all real, complex, half, bfloat16 and bool (sum = logical or).
std::vector<at::Tensor> reduce_flat_cpu(const std::vector<std::vector<at::Tensor>>& inputs,
                                        const std::vector<Bucket>& buckets);

}  // namespace fastdp
