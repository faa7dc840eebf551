#include "cpu/scatter_cpu.h"

#include "copy_layout.h"

namespace fastdp {

at::Tensor chunk_view(const at::Tensor& leaf, int64_t dim, const std::vector<int64_t>& sizes,
                      const std::vector<int64_t>& offsets, size_t r) {
  return leaf.narrow(dim, offsets[r], sizes[r]);
}

std::vector<std::vector<at::Tensor>> scatter_cpu(const std::vector<at::Tensor>& leaves,
                                                 const std::vector<std::vector<int64_t>>& splits,
                                                 const std::vector<int64_t>& dims) {
  const size_t replicas = splits.empty() ? 0 : splits[0].size();
  std::vector<std::vector<at::Tensor>> result(replicas);
  for (auto& row : result) row.reserve(leaves.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    const std::vector<int64_t> offsets = chunk_offsets(splits[i]);
    for (size_t r = 0; r < replicas; ++r) {
      result[r].push_back(chunk_view(leaves[i], dims[i], splits[i], offsets, r));
    }
  }
  return result;
}

}  // namespace fastdp
