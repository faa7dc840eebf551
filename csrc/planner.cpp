#include "planner.h"

#include <c10/util/Exception.h>

#include <numeric>

namespace fastdp {

std::vector<int64_t> chunk_sizes_for(int64_t size, int64_t num_devices) {
  TORCH_CHECK_VALUE(num_devices > 0, "fastdp.plan_chunks: need at least one device, got ",
                    num_devices);
  TORCH_CHECK_VALUE(size >= 0, "fastdp.plan_chunks: leaf size must be >= 0, got ", size);
  if (size == 0) return std::vector<int64_t>(num_devices, 0);
  const int64_t split = (size + num_devices - 1) / num_devices;
  std::vector<int64_t> out;
  out.reserve(num_devices);
  for (int64_t off = 0; off < size; off += split) out.push_back(std::min(split, size - off));
  return out;
}

std::vector<std::vector<int64_t>> plan_chunks(const std::vector<int64_t>& leaf_sizes,
                                              int64_t num_devices,
                                              const std::vector<int64_t>* chunk_sizes) {
  std::vector<std::vector<int64_t>> plan;
  plan.reserve(leaf_sizes.size());
  if (chunk_sizes != nullptr) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(chunk_sizes->size()) == num_devices,
                      "fastdp: chunk_sizes has ", chunk_sizes->size(), " entries but there are ",
                      num_devices, " devices");
    int64_t total = 0;
    for (int64_t c : *chunk_sizes) {
      TORCH_CHECK_VALUE(c >= 0, "fastdp: chunk_sizes must be non-negative, got ", c);
      total += c;
    }
    for (size_t i = 0; i < leaf_sizes.size(); ++i) {
      TORCH_CHECK_VALUE(leaf_sizes[i] == total, "fastdp: chunk_sizes sum to ", total,
                        " but input tensor ", i, " has batch size ", leaf_sizes[i],
                        " along the scatter dim");
      plan.push_back(*chunk_sizes);
    }
    return plan;
  }
  for (size_t i = 0; i < leaf_sizes.size(); ++i) {
    plan.push_back(chunk_sizes_for(leaf_sizes[i], num_devices));
    TORCH_CHECK_VALUE(plan[i].size() == plan[0].size(), "fastdp: input tensors split into different "
                      "numbers of chunks: tensor 0 (size ", leaf_sizes[0], ") into ",
                      plan[0].size(), ", tensor ", i, " (size ", leaf_sizes[i], ") into ",
                      plan[i].size(), " on ", num_devices, " devices. DataParallel would silently "
                      "drop rows; give every tensor a batch size that splits into the same number "
                      "of chunks, or pass non-batched data as a non-tensor");
  }
  return plan;
}

}  // namespace fastdp
