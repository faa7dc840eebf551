#include "gather.h"

#include <c10/core/GradMode.h>

#include "cpu/gather_cpu.h"
#ifdef WITH_CUDA
#include "cuda/gather_cuda.h"
#endif

namespace fastdp {

at::Tensor gather_into(const std::vector<at::Tensor>& tensors, int64_t dim,
                       at::Device destination) {
  constexpr const char* op = "fastdp.gather_into";
  TORCH_CHECK(!tensors.empty(), op, ": expected at least one tensor, got 0");
  TORCH_CHECK(destination.is_cpu() || destination.is_cuda(), op,
              ": expected a CPU or CUDA destination, got ", destination);
  bool any_cuda = destination.is_cuda();
  for (size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& t = tensors[k];
    TORCH_CHECK(t.defined() && t.layout() == at::kStrided && !t.is_quantized(), op, ": tensor ", k,
                " must be a dense strided tensor");
    TORCH_CHECK(t.is_cpu() || t.is_cuda(), op, ": tensor ", k,
                " must be on a CPU or CUDA device, got ", t.device());
    any_cuda = any_cuda || t.is_cuda();
  }
  c10::NoGradGuard no_grad;
  if (!any_cuda) return gather_cpu(tensors, dim);
#ifdef WITH_CUDA
  return gather_cuda(tensors, dim, destination);
#else
  TORCH_CHECK(false, op, ": CUDA tensors or destination given, but fastdp was built without CUDA");
#endif
}

}  // namespace fastdp
