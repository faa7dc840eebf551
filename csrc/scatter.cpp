#include "scatter.h"

#include <ATen/WrapDimUtils.h>
#include <c10/core/GradMode.h>

#include "cpu/scatter_cpu.h"
#ifdef WITH_CUDA
#include "cuda/scatter_cuda.h"
#endif

namespace fastdp {

std::vector<std::vector<at::Tensor>> scatter_chunks(const std::vector<at::Tensor>& leaves,
                                                    const std::vector<std::vector<int64_t>>& splits,
                                                    const std::vector<int64_t>& dims,
                                                    const std::vector<at::Device>& devices) {
  constexpr const char* op = "fastdp.scatter_chunks";
  TORCH_CHECK(splits.size() == leaves.size(), op, ": expected one split per leaf (", leaves.size(),
              "), got ", splits.size());
  const size_t replicas = splits.empty() ? 0 : splits[0].size();
  TORCH_CHECK(replicas <= devices.size(), op, ": the splits have ", replicas,
              " chunks per leaf but only ", devices.size(), " devices were given");
  TORCH_CHECK(dims.size() == 1 || dims.size() == leaves.size(), op,
              ": expected one dim for all leaves or one per leaf (", leaves.size(), "), got ",
              dims.size());
  std::vector<int64_t> wrapped(leaves.size());
  bool any_cuda = false;
  for (size_t i = 0; i < leaves.size(); ++i) {
    const at::Tensor& leaf = leaves[i];
    TORCH_CHECK(leaf.defined() && leaf.layout() == at::kStrided && !leaf.is_quantized(), op,
                ": leaf ", i, " must be a dense strided tensor");
    TORCH_CHECK(leaf.dim() > 0, op, ": leaf ", i, " is 0-dimensional and cannot be chunked");
    const int64_t d = at::maybe_wrap_dim(dims[dims.size() == 1 ? 0 : i], leaf.dim());
    wrapped[i] = d;
    TORCH_CHECK(splits[i].size() == replicas, op, ": expected ", replicas, " chunk sizes for leaf ",
                i, ", got ", splits[i].size());
    int64_t total = 0;
    for (int64_t n : splits[i]) {
      TORCH_CHECK(n >= 0, op, ": chunk sizes must be non-negative, got ", n, " for leaf ", i);
      total += n;
    }
    TORCH_CHECK(total == leaf.size(d), op, ": chunk sizes of leaf ", i, " sum to ", total,
                " but its size along dim ", d, " is ", leaf.size(d));
    any_cuda = any_cuda || leaf.is_cuda();
  }
  for (size_t r = 0; r < replicas; ++r) {
    TORCH_CHECK(devices[r].is_cpu() || devices[r].is_cuda(), op,
                ": expected CPU or CUDA devices, got ", devices[r]);
    any_cuda = any_cuda || devices[r].is_cuda();
  }
  c10::NoGradGuard no_grad;
  if (!any_cuda) return scatter_cpu(leaves, splits, wrapped);
#ifdef WITH_CUDA
  return scatter_cuda(leaves, splits, wrapped,
                      std::vector<at::Device>(devices.begin(), devices.begin() + replicas));
#else
  TORCH_CHECK(false, op, ": CUDA tensors or devices given, but fastdp was built without CUDA");
#endif
}

std::vector<at::Tensor> own_version_views(const std::vector<at::Tensor>& chunks) {
  std::vector<at::Tensor> out;
  out.reserve(chunks.size());
  for (const auto& c : chunks) {
    const at::TensorBase& root = c.is_view() ? c._base() : static_cast<const at::TensorBase&>(c);
    at::Tensor alias(root.unsafeGetTensorImpl()->shallow_copy_and_detach(
        c10::VariableVersion(/*version=*/0), /*allow_tensor_metadata_change=*/false));
    out.push_back(alias.as_strided(c.sizes(), c.strides(), c.storage_offset()));
  }
  return out;
}

std::vector<at::Tensor> split_own_versions(const std::vector<at::Tensor>& leaves,
                                           const std::vector<std::vector<int64_t>>& splits,
                                           const std::vector<int64_t>& dims) {
  constexpr const char* op = "fastdp.split_own_versions";
  const size_t n = leaves.size();
  TORCH_CHECK(splits.size() == n && (dims.size() == 1 || dims.size() == n), op,
              ": expected one split per leaf and one dim per leaf or for all");
  const size_t replicas = splits.empty() ? 0 : splits[0].size();
  std::vector<at::Tensor> out(replicas * n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& leaf = leaves[i];
    TORCH_CHECK(splits[i].size() == replicas, op, ": expected ", replicas, " chunk sizes for leaf ",
                i, ", got ", splits[i].size());
    const int64_t d = at::maybe_wrap_dim(dims[dims.size() == 1 ? 0 : i], leaf.dim());
    const bool own =
        !leaf.requires_grad() && !leaf.is_inference() && !leaf.is_conj() && !leaf.is_neg();
    auto chunks = leaf.split_with_sizes(splits[i], d);
    for (size_t r = 0; r < replicas; ++r) {
      if (own && r > 0) {
        chunks[r].unsafeGetTensorImpl()->set_version_counter(c10::VariableVersion(0));
      }
      out[r * n + i] = std::move(chunks[r]);
    }
  }
  return out;
}

}  // namespace fastdp
