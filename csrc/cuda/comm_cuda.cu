#include "cuda/comm_cuda.h"

#include <c10/cuda/CUDAGuard.h>

#include "cuda/nccl_comm.h"

namespace fastdp {

namespace {

// Bucket b of `ts` (contiguous, one device) as one contiguous 1-D tensor: a view of a lone tensor,
// else one cat kernel on the current stream (torch's flatten_dense_tensors).
at::Tensor pack(at::TensorList ts, const Bucket& b) {
  if (b.index.size() == 1) return ts[b.index[0]].view({-1});
  std::vector<at::Tensor> parts;
  parts.reserve(b.index.size());
  for (const auto j : b.index) parts.push_back(ts[j].view({-1}));
  return at::cat(parts);
}

std::vector<int> indices(const std::vector<at::Device>& devices) {
  std::vector<int> out;
  out.reserve(devices.size());
  for (const auto& d : devices) out.push_back(static_cast<int>(d.index()));
  return out;
}

// Sum in list order on the root device: x0 + x1 (each copied there when elsewhere, non-blocking;
// a + b == b + a bit for bit, so the order is that of the list), then add_ the others.
at::Tensor sum_by_copies(const std::vector<at::Tensor>& parts, size_t root) {
  const auto opts = parts[root].options();
  auto result = parts[0].to(opts, /*non_blocking=*/true) + parts[1].to(opts, /*non_blocking=*/true);
  for (size_t i = 2; i < parts.size(); ++i) result.add_(parts[i].to(opts, /*non_blocking=*/true));
  return result;
}

}  // namespace

void broadcast_flat_cuda(at::TensorList srcs, at::Device src_device,
                         const std::vector<Bucket>& buckets,
                         const std::vector<at::Device>& dst_devices,
                         const std::vector<std::vector<at::Tensor>>& dsts, const char* op) {
  if (buckets.empty() || dst_devices.empty()) return;
  c10::cuda::CUDAGuard guard(src_device);
  std::vector<at::Tensor> packed;
  packed.reserve(buckets.size());
  for (const auto& b : buckets) packed.push_back(pack(srcs, b));

  std::vector<at::Device> all{src_device};
  all.insert(all.end(), dst_devices.begin(), dst_devices.end());
  const auto devs = indices(all);
  if (nccl_usable(devs)) {
    std::vector<std::vector<at::Tensor>> bufs(buckets.size());
    for (size_t b = 0; b < buckets.size(); ++b) {
      bufs[b].push_back(packed[b]);
      for (const auto& d : dsts) bufs[b].push_back(d[b]);
    }
    nccl_broadcast(devs, bufs, /*root=*/0, op);
    return;
  }
  for (const auto& d : dsts) {
    for (size_t b = 0; b < buckets.size(); ++b) d[b].copy_(packed[b], /*non_blocking=*/true);
  }
}

std::vector<at::Tensor> reduce_flat_cuda(const std::vector<std::vector<at::Tensor>>& inputs,
                                         const std::vector<at::Device>& devices, int64_t root,
                                         const std::vector<Bucket>& buckets, const char* op) {
  const auto r = static_cast<size_t>(root);
  c10::cuda::OptionalCUDAGuard guard;
  std::vector<std::vector<at::Tensor>> packed(buckets.size());  // [bucket][input list]
  for (size_t i = 0; i < inputs.size(); ++i) {
    guard.set_device(devices[i]);
    for (size_t b = 0; b < buckets.size(); ++b) packed[b].push_back(pack(inputs[i], buckets[b]));
  }
  guard.set_device(devices[r]);
  const auto devs = indices(devices);
  const bool nccl = nccl_usable(devs);
  std::vector<at::Tensor> flats(buckets.size());
  std::vector<std::vector<at::Tensor>> nccl_sends;
  std::vector<at::Tensor> nccl_outs;
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (nccl && nccl_can_sum(buckets[b].dtype)) {
      flats[b] = at::empty({buckets[b].numel}, packed[b][r].options());
      nccl_sends.push_back(packed[b]);
      nccl_outs.push_back(flats[b]);
    } else {
      flats[b] = sum_by_copies(packed[b], r);
    }
  }
  if (!nccl_outs.empty()) nccl_reduce(devs, nccl_sends, nccl_outs, static_cast<int>(root), op);
  return flats;
}

}  // namespace fastdp
