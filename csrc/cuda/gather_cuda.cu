#include "cuda/gather_cuda.h"

#include "cuda/torch_cuda_headers.h"  // before any header that includes them

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include "copy_layout.h"
#include "cpu/gather_cpu.h"
#include "cuda/multi_copy.h"
#include "cuda/peer_access.h"
#include "cuda/pinned_pool.h"

namespace fastdp {
namespace {

// The bytes a copy reads from `t`: conj/neg bits materialised (a byte copy cannot apply them) and
// dense, so that its elements are one contiguous range starting at data_ptr().
at::Tensor readable(const at::Tensor& t, bool need_dense) {
  at::Tensor r = t.resolve_conj().resolve_neg();
  if (need_dense && !r.is_non_overlapping_and_dense()) r = r.contiguous();
  return r;
}

bool same_dense_layout(const at::Tensor& a, const at::Tensor& b) {
  return a.is_non_overlapping_and_dense() && b.is_non_overlapping_and_dense() &&
         a.sizes() == b.sizes() && a.strides() == b.strides();
}

void gather_to_device(const at::Tensor& out, const std::vector<at::Tensor>& tensors,
                      const std::vector<at::Tensor>& slices) {
  const c10::DeviceIndex device = out.get_device();
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device);
  std::vector<at::Tensor> srcs(tensors.size());  // what multi_copy reads, kept alive to the launch
  std::vector<CopySpec> specs;
  std::vector<size_t> spec_of;
  for (size_t k = 0; k < tensors.size(); ++k) {
    if (!slices[k].defined()) continue;
    const at::Tensor& t = tensors[k];
    if (t.is_cpu()) {  // rare (outputs left on the host): torch's H2D, async when pinned
      c10::cuda::CUDAGuard guard(device);
      slices[k].copy_(t, /*non_blocking=*/t.is_pinned());
      continue;
    }
    const c10::DeviceIndex src_device = t.get_device();
    srcs[k] = readable(t, /*need_dense=*/src_device != device);
    if (src_device != device) {
      const c10::cuda::CUDAStream src_stream = c10::cuda::getCurrentCUDAStream(src_device);
      TORCH_CHECK(!stream_capturing(stream) && !stream_capturing(src_stream),
                  "fastdp.gather_into: copies between GPUs (cuda:", static_cast<int>(src_device),
                  " -> cuda:", static_cast<int>(device), ") are not captured in CUDA graphs by ",
                  "fastdp: capture on one device, or set FASTDP_DISABLE_EXT=1 for torch's copies");
      const bool straight = same_dense_layout(srcs[k], slices[k]);
      at::Tensor landing = straight ? slices[k]
                                    : at::empty_strided(srcs[k].sizes(), srcs[k].strides(),
                                                        srcs[k].options().device(out.device()));
      peer_copy(landing.data_ptr(), stream, srcs[k].data_ptr(), src_stream,
                static_cast<size_t>(srcs[k].numel() * srcs[k].element_size()));
      if (p2p_usable(src_device, device)) srcs[k].record_stream(stream);
      if (straight) continue;
      srcs[k] = landing;
    }
    specs.push_back({srcs[k].data_ptr(), slices[k].data_ptr(), srcs[k].element_size(),
                     srcs[k].sizes(), srcs[k].strides(), slices[k].strides()});
    spec_of.push_back(k);
  }
  for (size_t j : multi_copy(specs, stream)) {
    c10::cuda::CUDAGuard guard(device);
    slices[spec_of[j]].copy_(srcs[spec_of[j]]);
  }
}

// One GPU source on its way to the host: its pinned block and the event that says it arrived.
struct InFlight {
  size_t k;
  at::Tensor src;
  PinnedBlock block;
  at::cuda::CUDAEvent arrived;
};

void gather_to_host(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& slices) {
  std::vector<InFlight> in_flight;
  in_flight.reserve(tensors.size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    if (!slices[k].defined() || !tensors[k].is_cuda()) continue;
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(tensors[k].get_device());
    TORCH_CHECK(!stream_capturing(stream), "fastdp.gather_into: a gather to the CPU waits for ",
                "its copies and cannot be captured into a CUDA graph: gather to a GPU inside ",
                "the capture and copy to the host after it");
    at::Tensor src = readable(tensors[k], /*need_dense=*/true);
    const size_t nbytes = static_cast<size_t>(src.numel() * src.element_size());
    PinnedBlock block = pinned_acquire(nbytes, stream);
    if (!block) {  // larger than the pool: torch's synchronous D2H
      slices[k].copy_(src);
      continue;
    }
    c10::cuda::CUDAGuard guard(src.get_device());
    C10_CUDA_CHECK(
        cudaMemcpyAsync(block.data(), src.data_ptr(), nbytes, cudaMemcpyDeviceToHost, stream));
    block.record(stream);
    in_flight.push_back({k, std::move(src), std::move(block), at::cuda::CUDAEvent()});
    in_flight.back().arrived.record(stream);
  }
  for (size_t k = 0; k < tensors.size(); ++k) {  // host sources meanwhile
    if (slices[k].defined() && tensors[k].is_cpu()) slices[k].copy_(tensors[k]);
  }
  for (InFlight& p : in_flight) {
    p.arrived.synchronize();  // this copy only, never the device
    slices[p.k].copy_(at::from_blob(p.block.data(), p.src.sizes(), p.src.strides(),
                                    p.src.options().device(at::kCPU).pinned_memory(false)));
    p.block.reset();
  }
}

}  // namespace

at::Tensor gather_cuda(const std::vector<at::Tensor>& tensors, int64_t dim,
                       at::Device destination) {
  if (destination.is_cuda() && !destination.has_index()) {
    destination = at::Device(at::kCUDA, c10::cuda::current_device());
  }
  TORCH_CHECK(!destination.is_cuda() || destination.index() < c10::cuda::device_count(),
              "fastdp.gather_into: expected a CUDA device index below ",
              static_cast<int>(c10::cuda::device_count()), ", got ", destination);
  at::Tensor out = empty_cat_output(tensors, dim, destination, "fastdp.gather_into");
  const std::vector<at::Tensor> slices = cat_slices(out, tensors, dim);
  if (destination.is_cuda()) {
    gather_to_device(out, tensors, slices);
  } else {
    gather_to_host(tensors, slices);
  }
  return out;
}

}  // namespace fastdp
