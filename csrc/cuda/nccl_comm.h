#pragma once
// NCCL communicators cached per device tuple, and the grouped collectives that the coalesced
// broadcast / reduce-add (csrc/cuda/comm_cuda.cu) issue. See NOTE [ NCCL communicators ].
// Compiles without NCCL (FASTDP_WITH_NCCL undefined): nccl_usable() is then always false.

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace fastdp {

// Whether this build links NCCL (setup.py found it in the torch wheel or the system).
bool nccl_compiled();

// Whether one grouped NCCL call can serve CUDA device indices `devices` (rank order): NCCL linked,
// at least two devices, all distinct (NCCL cannot put two ranks of a clique on one GPU).
bool nccl_usable(const std::vector<int>& devices);

// Whether ncclReduce can sum `dtype`: reals, half, bfloat16, complex (as pairs of reals), bool (as
// max over uint8). Others (int16, unsigned > 8 bit, float8) take the device-copy path.
bool nccl_can_sum(at::ScalarType dtype);

// One NCCL group: for every bucket b, the bytes of bufs[b][root] are broadcast into bufs[b][r] for
// every rank r. bufs[b][r]: contiguous, on devices[r], equal nbytes per b; bufs[b][root] is only
// read. Queued on each device's current stream; returns once enqueued. nccl_usable(devices).
void nccl_broadcast(const std::vector<int>& devices,
                    const std::vector<std::vector<at::Tensor>>& bufs, int root, const char* op);

// One NCCL group: for every bucket b, outs[b] (contiguous, on devices[root]) = sum over ranks r of
// sends[b][r] (contiguous, on devices[r], same dtype and numel), in NCCL's summation order.
// nccl_can_sum(dtype) for every bucket. Streams and ordering as nccl_broadcast.
void nccl_reduce(const std::vector<int>& devices,
                 const std::vector<std::vector<at::Tensor>>& sends,
                 const std::vector<at::Tensor>& outs, int root, const char* op);

// The cached communicators for `devices` (created on first use, single rank included): one
// (cuda device, rank, number of ranks) per rank, as NCCL reports them. Raises without NCCL.
std::vector<std::tuple<int64_t, int64_t, int64_t>> nccl_communicator_info(
    const std::vector<int64_t>& devices);

}  // namespace fastdp
