#include "transfer.h"

#include <c10/util/Exception.h>

#include <algorithm>

#ifdef WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>

#include "cuda/peer_access.h"
#endif

namespace fastdp {
namespace {
constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kOneShot = 16 * kMiB;  // up to this, one block and one copy per device
constexpr size_t kWindow = 8 * kMiB;    // beyond, windows this size pipeline pack and copy
}  // namespace

size_t staging_window_for(size_t total, size_t capacity) {
  if (total <= std::min(capacity, kOneShot)) return total;
  return std::min(capacity / 2, kWindow);
}

size_t scatter_window_for(size_t total, size_t capacity) {
  if (total <= std::min(capacity, kMiB)) return total;
  constexpr size_t kStep = size_t{64} << 10;
  const size_t half = ((total + 1) / 2 + kStep - 1) / kStep * kStep;
  const size_t w = std::min(std::max(half, kMiB), 4 * kMiB);
  return std::min(w, capacity / 2 / kStep * kStep);
}

size_t staged_copy_window(size_t total, size_t capacity) {
  const size_t w = staging_window_for(total, capacity);
  if (w == total || w >= kMiB) return w;
  return std::min(total, kWindow);  // staging off or a tiny pool: pageable windows
}

#ifdef WITH_CUDA
// pinned_pool_stats, pinned_pool_set_capacity, pinned_pool_empty_cache: cuda/pinned_pool.cpp.

bool peer_access(int64_t a, int64_t b) {
  const int64_t n = c10::cuda::device_count();
  TORCH_CHECK(a >= 0 && a < n && b >= 0 && b < n,
              "fastdp.peer_access: expected device indices in [0, ", n, "), got ", a, " and ", b);
  return p2p_usable(static_cast<c10::DeviceIndex>(a), static_cast<c10::DeviceIndex>(b));
}
#else
std::vector<std::pair<std::string, int64_t> > pinned_pool_stats() { return {}; }

int64_t pinned_pool_set_capacity(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "fastdp.pinned_pool_set_capacity: expected bytes >= 0, got ", bytes);
  return 0;
}

void pinned_pool_empty_cache() {}

bool peer_access(int64_t /*a*/, int64_t /*b*/) { return false; }
#endif

}  // namespace fastdp
