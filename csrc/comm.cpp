#include "comm.h"

#include <ATen/core/LegacyTypeDispatch.h>

#include "comm_buckets.h"
#include "cpu/comm_cpu.h"

#ifdef WITH_CUDA
#include "cuda/comm_cuda.h"
#include "cuda/nccl_comm.h"
#endif

// NOTE [ Coalesced comm semantics ]
// What torch.nn.parallel.comm does, and what we keep:
// - broadcast_coalesced: result[0] is the input list itself (same TensorImpls, so the same Python
//   objects); every other result is a contiguous view into a flat per-dtype bucket on its device,
//   re-wrapped in a fresh TensorImpl so that it has its own version counter and no autograd
//   history (torch's NOTE [ Version Counter in comm.*_coalesced ]). Like torch, outputs are
//   contiguous whatever the input strides (channels_last included): the flat layout is the point.
// - Buckets: torch's C++ take_tensors (broadcast) closes a bucket once it reaches the limit, its
//   Python _take_tensors (reduce) before a tensor would overflow it. We use the Python rule for
//   both: a bucket is <= buffer_size bytes unless it holds one larger tensor. Only which outputs
//   share a storage can tell the two apart; values never depend on bucketing.
// - reduce_add_coalesced sums in list order, x0 + x1 + ..., each step rounded to the dtype: the
//   CPU and device-copy paths are bit-identical to fastdp.comm's torch path (and to torch's
//   non-NCCL reduce_add for two lists; for more, torch adds the last list on the destination
//   first). NCCL (distinct GPUs) sums in its own order, as torch's NCCL path does: equal within
//   float tolerance, exact for integers. Differences from torch: CPU devices are supported (torch's
//   reduce_add rejects them); one input list gives contiguous clones (torch returns views of the
//   inputs or copies, depending on bucketing).
// - Autograd: these are the primitives under the Broadcast / ReduceAddCoalesced Functions; the
//   work runs below autograd, outputs never require grad, inputs are never modified except the
//   outs of broadcast_coalesced_into, whose version counters are bumped.
// - Sparse tensors are rejected here; fastdp/comm.py routes them to torch.

namespace fastdp {

namespace {

void check_dense(const at::Tensor& t, const char* op, const char* what, size_t i) {
  TORCH_CHECK(t.defined(), op, ": ", what, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, op,
              ": only dense (strided) tensors are supported by the extension, got layout ",
              t.layout(), " for ", what, "[", i, "] (fastdp.comm falls back to torch for sparse)");
}

// True for CUDA, false for CPU; raises for anything else or a mix.
bool check_device_kind(const std::vector<at::Device>& devices, const char* op) {
  const bool cuda = devices[0].is_cuda();
  for (const auto& d : devices) {
    TORCH_CHECK(d.is_cpu() || d.is_cuda(), op, ": expected CPU or CUDA devices, got ", d);
    TORCH_CHECK(d.is_cuda() == cuda, op, ": devices must be all CPU or all CUDA, got ",
                devices[0], " and ", d);
    TORCH_CHECK(!cuda || d.has_index(), op, ": CUDA devices need an index, got ", d);
  }
#ifndef WITH_CUDA
  TORCH_CHECK(!cuda, op, ": this fastdp build has no CUDA support");
#endif
  return cuda;
}

// Plain contiguous memory, lazy conj/neg bits materialised: what a flat copy can read.
std::vector<at::Tensor> materialized(at::TensorList ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) {
    if (t.is_contiguous() && !t.is_conj() && !t.is_neg()) {
      out.push_back(t);
    } else {
      out.push_back(t.resolve_conj().resolve_neg().contiguous());
    }
  }
  return out;
}

// AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND3(Half, BFloat16, Bool): what the CPU kernel and at::add
// sum (NCCL sums a subset; the others take the device-copy path between GPUs).
bool summable(at::ScalarType dt) {
  switch (dt) {
    case at::kByte: case at::kChar: case at::kShort: case at::kInt: case at::kLong:
    case at::kHalf: case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kBool:
    case at::kComplexFloat: case at::kComplexDouble:
      return true;
    default:
      return false;
  }
}

// Broadcast moves bytes (memcpy, cat, copy_, NCCL bytes): a few more dtypes.
bool copyable(at::ScalarType dt) {
  return summable(dt) || at::isFloat8Type(dt) || dt == at::kComplexHalf || dt == at::kUInt16 ||
         dt == at::kUInt32 || dt == at::kUInt64;
}

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* what,
                size_t k, size_t j) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type() && t.sizes().equals(ref.sizes()), op, ": ",
              what, "[", k, "][", j, "] has dtype ", t.scalar_type(), " and size ", t.sizes(),
              ", expected ", ref.scalar_type(), " and ", ref.sizes());
}

}  // namespace

std::vector<std::vector<at::Tensor>> broadcast_coalesced(at::TensorList tensors,
                                                         const std::vector<at::Device>& devices,
                                                         int64_t buffer_size) {
  constexpr const char* op = "fastdp.broadcast_coalesced";
  TORCH_CHECK(!devices.empty(), op, ": expected at least one device, got none");
  TORCH_CHECK(buffer_size > 0, op, ": buffer_size must be positive, got ", buffer_size);
  const bool cuda = check_device_kind(devices, op);
  for (size_t j = 0; j < tensors.size(); ++j) {
    check_dense(tensors[j], op, "tensors", j);
    TORCH_CHECK(tensors[j].device() == devices[0], op, ": all tensors must be on devices[0] (",
                devices[0], "), but tensors[", j, "] is on ", tensors[j].device());
  }
  std::vector<std::vector<at::Tensor>> result(devices.size());
  result[0] = tensors.vec();
  if (devices.size() == 1) return result;

  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto srcs = materialized(tensors);
  const auto buckets = take_buckets(srcs, buffer_size);
  const std::vector<at::Device> dst_devices(devices.begin() + 1, devices.end());
  std::vector<std::vector<at::Tensor>> flats(dst_devices.size());
  for (size_t k = 0; k < dst_devices.size(); ++k) {
    for (const auto& b : buckets) {
      flats[k].push_back(at::empty({b.numel}, at::TensorOptions().dtype(b.dtype).device(
                                                   dst_devices[k])));
    }
  }
#ifdef WITH_CUDA
  if (cuda) {
    broadcast_flat_cuda(srcs, devices[0], buckets, dst_devices, flats, op);
  } else
#endif
  {
    (void)cuda;
    broadcast_flat_cpu(srcs, buckets, flats);
  }
  for (size_t k = 0; k < dst_devices.size(); ++k) {
    auto& out = result[k + 1];
    out.resize(tensors.size());
    for (size_t b = 0; b < buckets.size(); ++b) unflatten_bucket(flats[k][b], buckets[b], tensors, out);
  }
  return result;
}

void broadcast_coalesced_into(at::TensorList tensors,
                              const std::vector<std::vector<at::Tensor>>& outs) {
  constexpr const char* op = "fastdp.broadcast_coalesced_into";
  if (tensors.empty() || outs.empty()) {
    for (size_t k = 0; k < outs.size(); ++k) {
      TORCH_CHECK(outs[k].empty(), op, ": outs[", k, "] has ", outs[k].size(),
                  " tensors, expected 0 (one per input tensor)");
    }
    return;
  }
  std::vector<at::Device> devices{tensors[0].device()};
  for (size_t j = 0; j < tensors.size(); ++j) {
    check_dense(tensors[j], op, "tensors", j);
    TORCH_CHECK(tensors[j].device() == devices[0], op, ": all tensors must be on one device (",
                devices[0], "), but tensors[", j, "] is on ", tensors[j].device());
  }
  for (size_t k = 0; k < outs.size(); ++k) {
    TORCH_CHECK(outs[k].size() == tensors.size(), op, ": outs[", k, "] has ", outs[k].size(),
                " tensors, expected ", tensors.size(), " (one per input tensor)");
    devices.push_back(outs[k][0].device());
    for (size_t j = 0; j < tensors.size(); ++j) {
      check_dense(outs[k][j], op, "outs[k]", j);
      check_like(outs[k][j], tensors[j], op, "outs", k, j);
      TORCH_CHECK(outs[k][j].device() == devices.back(), op, ": outs[", k,
                  "] must be on one device, found ", devices.back(), " and ", outs[k][j].device());
    }
  }
  const bool cuda = check_device_kind(devices, op);

  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto srcs = materialized(tensors);
  std::vector<std::pair<size_t, size_t>> strided;  // (k, j): copied one by one
#ifdef WITH_CUDA
  if (cuda) {
    std::vector<int64_t> loose;
    const auto runs = dense_runs(srcs, outs, loose);
    const std::vector<at::Device> dst_devices(devices.begin() + 1, devices.end());
    broadcast_flat_cuda(srcs, devices[0], runs, dst_devices, run_aliases(runs, outs), op);
    for (const auto j : loose) {
      for (size_t k = 0; k < outs.size(); ++k) strided.emplace_back(k, static_cast<size_t>(j));
    }
  } else
#endif
  {
    (void)cuda;
    strided = copy_into_cpu(srcs, outs);
  }
  for (const auto& [k, j] : strided) outs[k][j].copy_(srcs[j], /*non_blocking=*/true);
  for (const auto& o : outs) {
    for (const auto& t : o) {
      if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
    }
  }
}

std::vector<at::Tensor> reduce_add_coalesced(const std::vector<std::vector<at::Tensor>>& inputs,
                                             at::Device destination, int64_t buffer_size) {
  constexpr const char* op = "fastdp.reduce_add_coalesced";
  TORCH_CHECK(!inputs.empty(), op, ": expected at least one input list, got none");
  TORCH_CHECK(buffer_size > 0, op, ": buffer_size must be positive, got ", buffer_size);
  const auto& ref = inputs[0];
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].size() == ref.size(), op, ": inputs[", i, "] has ", inputs[i].size(),
                " tensors, expected ", ref.size(), " like inputs[0]");
  }
  if (ref.empty()) return {};
  std::vector<at::Device> devices;
  int64_t root = -1;
  for (size_t i = 0; i < inputs.size(); ++i) {
    devices.push_back(inputs[i][0].device());
    if (devices.back() == destination) root = static_cast<int64_t>(i);
    for (size_t j = 0; j < ref.size(); ++j) {
      check_dense(inputs[i][j], op, "inputs[i]", j);
      check_like(inputs[i][j], ref[j], op, "inputs", i, j);
      TORCH_CHECK(inputs[i][j].device() == devices.back(), op, ": inputs[", i,
                  "] must be on one device, found ", devices.back(), " and ",
                  inputs[i][j].device());
    }
  }
  const bool cuda = check_device_kind(devices, op);
  TORCH_CHECK(root >= 0, op, ": destination ", destination,
              " must be the device of one of the input lists (as torch's reduce_add)");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  if (inputs.size() == 1) {
    std::vector<at::Tensor> copies;
    for (const auto& t : ref) copies.push_back(at::clone(t, at::MemoryFormat::Contiguous));
    return copies;
  }
  std::vector<std::vector<at::Tensor>> srcs;
  srcs.reserve(inputs.size());
  for (const auto& in : inputs) srcs.push_back(materialized(in));
  const auto buckets = take_buckets(srcs[0], buffer_size);
  std::vector<at::Tensor> flats;
#ifdef WITH_CUDA
  if (cuda) {
    flats = reduce_flat_cuda(srcs, devices, root, buckets, op);
  } else
#endif
  {
    (void)cuda;
    flats = reduce_flat_cpu(srcs, buckets);
  }
  std::vector<at::Tensor> result(ref.size());
  for (size_t b = 0; b < buckets.size(); ++b) unflatten_bucket(flats[b], buckets[b], ref, result);
  return result;
}

bool coalesced_supported(at::TensorList tensors, bool reduce) {
  for (const auto& t : tensors) {
    if (!t.defined() || t.layout() != at::kStrided) return false;
    if (!(reduce ? summable(t.scalar_type()) : copyable(t.scalar_type()))) return false;
  }
  return true;
}

bool nccl_available() {
#ifdef WITH_CUDA
  return nccl_compiled();
#else
  return false;
#endif
}

std::vector<std::tuple<int64_t, int64_t, int64_t>> nccl_comm_info(const std::vector<int64_t>& devices) {
#ifdef WITH_CUDA
  return nccl_communicator_info(devices);
#else
  (void)devices;
  TORCH_CHECK(false, "fastdp.nccl_comm_info: this fastdp build has no CUDA support");
#endif
}

}  // namespace fastdp
