#pragma once
// Scatter planner: how every input leaf of one forward is chunked across replicas.

#include <cstdint>
#include <vector>

namespace fastdp {

// Chunk sizes along the scatter dim for each leaf, torch.chunk semantics per leaf:
// split = ceil(size / num_devices), so a leaf yields ceil(size / split) chunks (num_devices chunks of
// 0 when size == 0). Every leaf must yield the same number of chunks; otherwise a ValueError naming
// both leaves (DataParallel silently drops the extra rows). With `chunk_sizes` (one per device,
// non-negative) every leaf must have size == sum(chunk_sizes); zero entries stay in the result.
// Result: one vector per leaf, all of the same length (the number of replicas that run).
std::vector<std::vector<int64_t>> plan_chunks(const std::vector<int64_t>& leaf_sizes,
                                              int64_t num_devices,
                                              const std::vector<int64_t>* chunk_sizes);

// torch.chunk's sizes for one leaf (the building block of plan_chunks).
std::vector<int64_t> chunk_sizes_for(int64_t size, int64_t num_devices);

}  // namespace fastdp
