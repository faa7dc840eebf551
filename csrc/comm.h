#pragma once
// Coalesced broadcast and reduce-add: torch.nn.parallel.comm.{broadcast,reduce_add}_coalesced for
// CPU "devices" (virtual replicas), repeated CUDA ids (device copies) and distinct CUDA devices
// (one grouped NCCL call). Dispatches to csrc/cpu/comm_cpu.* and csrc/cuda/comm_cuda.*.
// See NOTE [ Coalesced comm semantics ] in comm.cpp.

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace fastdp {

// torch.nn.parallel.comm.broadcast_coalesced: result[0] ARE `tensors` (same TensorImpls); result[d]
// for d > 0 holds bit-identical contiguous copies on devices[d], views into flat per-dtype buckets
// of <= buffer_size bytes, each with its own version counter and no autograd history. Devices: all
// CPU, or all CUDA with an index; tensors dense and on devices[0]. Work is queued on each device's
// current stream (CUDA): results are ready in that order, not synchronised with the host.
std::vector<std::vector<at::Tensor>> broadcast_coalesced(at::TensorList tensors,
                                                         const std::vector<at::Device>& devices,
                                                         int64_t buffer_size);

// Refreshes persistent copies in place, one call per step: afterwards outs[k][j] == tensors[j]
// bit for bit, for every destination k. outs[k] lives on one device (CPU or CUDA, the same kind as
// tensors'); shapes and dtypes equal tensors'. CPU: one parallel memcpy pass over everything. CUDA:
// destinations laid out as buckets (e.g. result[1:] of broadcast_coalesced) take one NCCL op or
// copy per bucket, other layouts one copy per tensor. Bumps every out's version counter; outs must
// not overlap each other or `tensors`. Streams and ordering as broadcast_coalesced.
void broadcast_coalesced_into(at::TensorList tensors,
                              const std::vector<std::vector<at::Tensor>>& outs);

// torch.nn.parallel.comm.reduce_add_coalesced: result[j] = inputs[0][j] + inputs[1][j] + ... in
// list order (each add rounded to the dtype: bit-identical to fastdp.comm's torch path), on
// `destination`, which must be the device of one input list. Between distinct GPUs one grouped NCCL
// reduce, in NCCL's order (float tolerance, exact for integers). Results are fresh contiguous views
// into flat buckets (one input list: contiguous clones). Sparse tensors are rejected.
std::vector<at::Tensor> reduce_add_coalesced(const std::vector<std::vector<at::Tensor>>& inputs,
                                             at::Device destination, int64_t buffer_size);

// Whether the coalesced ops serve every tensor: strided layout and a dtype they handle (reduce:
// (u)int8..int64, half, bfloat16, float, double, complex64/128, bool; broadcast: also float8,
// complex32, uint16/32/64). One call per list: fastdp.comm's per-call choice of extension or torch.
bool coalesced_supported(at::TensorList tensors, bool reduce);

// Whether this build can use NCCL (CUDA build that found NCCL); false on CPU builds.
bool nccl_available();

// The cached NCCL communicators for CUDA device indices `devices` (rank order), created on first
// use: one (cuda device, rank, number of ranks) per rank. Raises on builds without NCCL.
std::vector<std::tuple<int64_t, int64_t, int64_t>> nccl_comm_info(const std::vector<int64_t>& devices);

}  // namespace fastdp
