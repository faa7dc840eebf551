#include "cuda/scatter_cuda.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <utility>

#include "copy_layout.h"
#include "cpu/scatter_cpu.h"
#include "cuda/multi_copy.h"
#include "cuda/peer_access.h"
#include "cuda/pinned_pool.h"
#include "cuda/scatter_host_cuda.h"

namespace fastdp {
namespace {

// CPU leaves -> CUDA device: pinned and pageable chunks in buffers of their own. `pinned[i]`:
// whether leaf i is pinned (asked once per leaf: a lookup in the host allocator).
void scatter_from_host(std::vector<ChunkCopy*>& copies, const std::vector<char>& pinned,
                       c10::DeviceIndex device, std::vector<std::vector<at::Tensor>>& result) {
  std::vector<ChunkCopy*> from_pinned, from_pageable;
  for (ChunkCopy* c : copies) (pinned[c->i] ? from_pinned : from_pageable).push_back(c);
  if (!from_pinned.empty()) scatter_pinned(from_pinned, device, result);
  if (!from_pageable.empty()) scatter_pageable(from_pageable, device, result);
}

// Leaves on GPU `src` -> GPU `device`: one multi_copy pack on src, one peer copy.
void scatter_from_device(std::vector<ChunkCopy*>& copies, c10::DeviceIndex src,
                         c10::DeviceIndex device, std::vector<std::vector<at::Tensor>>& result) {
  const c10::cuda::CUDAStream src_stream = c10::cuda::getCurrentCUDAStream(src);
  const c10::cuda::CUDAStream dst_stream = c10::cuda::getCurrentCUDAStream(device);
  TORCH_CHECK(!stream_capturing(src_stream) && !stream_capturing(dst_stream),
              "fastdp.scatter_chunks: copies between GPUs (cuda:", static_cast<int>(src),
              " -> cuda:", static_cast<int>(device),
              ") are not captured in CUDA graphs by fastdp: "
              "capture on one device, or set FASTDP_DISABLE_EXT=1 for torch's copies");
  const int64_t total = lay_out(copies, 0);
  const at::TensorOptions bytes = at::TensorOptions().dtype(at::kByte);
  at::Tensor buf = at::empty({total}, bytes.device(at::kCUDA, device));
  for (ChunkCopy* c : copies) {
    result[c->r][c->i] =
        view_into(buf, c->offset, c->chunk.scalar_type(), c->chunk.sizes(), c->strides);
  }
  if (total == 0) return;
  at::Tensor from;  // what the peer copy reads: the chunk itself when it alone is already packed
  if (copies.size() == 1 && copies[0]->chunk.is_non_overlapping_and_dense() &&
      !copies[0]->chunk.is_conj() && !copies[0]->chunk.is_neg()) {
    from = copies[0]->chunk;
  } else {
    c10::cuda::CUDAGuard guard(src);
    at::Tensor staging = at::empty({total}, bytes.device(at::kCUDA, src));
    std::vector<at::Tensor> srcs;
    std::vector<CopySpec> specs;
    srcs.reserve(copies.size());
    for (ChunkCopy* c : copies) {
      srcs.push_back(c->chunk.resolve_conj().resolve_neg());
      specs.push_back({srcs.back().data_ptr(), static_cast<char*>(staging.data_ptr()) + c->offset,
                       srcs.back().element_size(), srcs.back().sizes(), srcs.back().strides(),
                       c->strides});
    }
    for (size_t k : multi_copy(specs, src_stream)) {
      view_into(staging, copies[k]->offset, srcs[k].scalar_type(), srcs[k].sizes(),
                copies[k]->strides)
          .copy_(srcs[k]);
    }
    from = staging;
  }
  // Both layouts start at offset 0: a lone packed chunk is byte for byte its own region.
  peer_copy(buf.data_ptr(), dst_stream, from.data_ptr(), src_stream, static_cast<size_t>(total));
  if (p2p_usable(src, device)) from.record_stream(dst_stream);  // read on the destination stream
}

}  // namespace

std::vector<std::vector<at::Tensor>> scatter_cuda(const std::vector<at::Tensor>& leaves,
                                                  const std::vector<std::vector<int64_t>>& splits,
                                                  const std::vector<int64_t>& dims,
                                                  const std::vector<at::Device>& devices) {
  std::vector<at::Device> devs = devices;
  for (at::Device& d : devs) {
    if (d.is_cuda() && !d.has_index()) d = at::Device(at::kCUDA, c10::cuda::current_device());
    TORCH_CHECK(!d.is_cuda() || d.index() < c10::cuda::device_count(),
                "fastdp.scatter_chunks: expected CUDA device indices below ",
                static_cast<int>(c10::cuda::device_count()), ", got ", d);
  }
  std::vector<std::vector<at::Tensor>> result(devs.size(), std::vector<at::Tensor>(leaves.size()));
  std::vector<ChunkCopy> copies;
  copies.reserve(leaves.size() * devs.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    const std::vector<int64_t> offsets = chunk_offsets(splits[i]);
    for (size_t r = 0; r < devs.size(); ++r) {
      at::Tensor chunk = chunk_view(leaves[i], dims[i], splits[i], offsets, r);
      if (devs[r] == leaves[i].device()) {
        result[r][i] = std::move(chunk);  // stays: a view, as torch
      } else if (devs[r].is_cpu()) {
        result[r][i] = chunk.to(devs[r]);  // GPU leaf to a CPU replica: torch's synchronous copy
      } else {
        copies.push_back({r, i, chunk, to_copy_strides(chunk)});
        copies.back().nbytes = chunk.numel() * chunk.element_size();
      }
    }
  }
  // Group by (destination, source); -1 is the CPU. One buffer per group.
  std::map<std::pair<int, int>, std::vector<ChunkCopy*>> groups;
  std::vector<char> pinned(leaves.size(), 0);
  for (ChunkCopy& c : copies) {
    const at::Tensor& leaf = leaves[c.i];
    groups[{devs[c.r].index(), leaf.is_cuda() ? leaf.get_device() : -1}].push_back(&c);
  }
  for (size_t i = 0; i < leaves.size(); ++i) {
    pinned[i] = leaves[i].is_cpu() && leaves[i].is_pinned();
  }
  for (auto& [key, group] : groups) {
    if (key.second < 0) {
      scatter_from_host(group, pinned, key.first, result);
    } else {
      scatter_from_device(group, key.second, key.first, result);
    }
  }
  return result;
}

}  // namespace fastdp
