#include "cpu/gather_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/WrapDimUtils.h>

#include "copy_layout.h"

namespace fastdp {

std::vector<at::Tensor> cat_slices(const at::Tensor& out, const std::vector<at::Tensor>& tensors,
                                   int64_t dim) {
  std::vector<at::Tensor> slices(tensors.size());
  if (out.numel() == 0) return slices;
  const int64_t d = at::maybe_wrap_dim(dim, out.dim());
  int64_t offset = 0;
  for (size_t k = 0; k < tensors.size(); ++k) {
    // An empty tensor adds nothing along `dim` once the output is non-empty (or is a legacy 1-D
    // empty tensor that torch.cat skips).
    if (tensors[k].numel() == 0) continue;
    slices[k] = out.narrow(d, offset, tensors[k].size(d));
    offset += tensors[k].size(d);
  }
  TORCH_INTERNAL_ASSERT(offset == out.size(d), "fastdp.gather_into: slices cover ", offset, " of ",
                        out.size(d));
  return slices;
}

at::Tensor gather_cpu(const std::vector<at::Tensor>& tensors, int64_t dim) {
  at::Tensor out = empty_cat_output(tensors, dim, at::kCPU, "fastdp.gather_into");
  const std::vector<at::Tensor> slices = cat_slices(out, tensors, dim);
  const int64_t n = static_cast<int64_t>(tensors.size());
  auto copy_range = [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      if (slices[k].defined()) slices[k].copy_(tensors[k]);
    }
  };
  // Few tensors: each copy_ is itself parallel. Many: one task per tensor (copies inside a
  // parallel region run single-threaded, so this only pays off with >= one tensor per thread).
  if (n >= at::get_num_threads() && out.numel() > 0) {
    at::parallel_for(0, n, 1, copy_range);
  } else {
    copy_range(0, n);
  }
  return out;
}

}  // namespace fastdp
