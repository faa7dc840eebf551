#include "cuda/multi_copy.h"

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "cuda/pinned_pool.h"

namespace fastdp {
namespace {

constexpr int kMaxDims = 8;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kTileUnits = 4096;  // units one block copies

// One copy after merging: units of `width` bytes, dims outermost first, strides in units.
struct Desc {
  const char* src;
  char* dst;
  int64_t numel;
  int32_t ndim;
  int32_t width;
  int64_t sizes[kMaxDims];
  int64_t src_strides[kMaxDims];
  int64_t dst_strides[kMaxDims];
};

template <int kKind>  // 1: one dim, 2: two dims, 0: any
__device__ __forceinline__ void offsets(const Desc& d, int64_t e, int64_t& so, int64_t& dof) {
  if (kKind == 1) {
    so = e * d.src_strides[0];
    dof = e * d.dst_strides[0];
  } else if (kKind == 2) {
    const int64_t outer = e / d.sizes[1], inner = e - outer * d.sizes[1];
    so = outer * d.src_strides[0] + inner * d.src_strides[1];
    dof = outer * d.dst_strides[0] + inner * d.dst_strides[1];
  } else {
    so = 0;
    dof = 0;
    for (int k = d.ndim - 1; k >= 0; --k) {
      const int64_t q = e / d.sizes[k], i = e - q * d.sizes[k];
      so += i * d.src_strides[k];
      dof += i * d.dst_strides[k];
      e = q;
    }
  }
}

template <typename T, int kKind>
__device__ void copy_units(const Desc& d, int64_t begin, int64_t end) {
  const T* __restrict__ src = reinterpret_cast<const T*>(d.src);
  T* __restrict__ dst = reinterpret_cast<T*>(d.dst);
  for (int64_t base = begin + threadIdx.x; base < end; base += kUnroll * blockDim.x) {
    T v[kUnroll];
    int64_t dof[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t e = base + u * static_cast<int64_t>(blockDim.x);
      if (e < end) {
        int64_t so;
        offsets<kKind>(d, e, so, dof[u]);
        v[u] = src[so];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * static_cast<int64_t>(blockDim.x) < end) dst[dof[u]] = v[u];
    }
  }
}

template <typename T>
__device__ void copy_tile(const Desc& d, int64_t begin, int64_t end) {
  if (d.ndim == 1) {
    copy_units<T, 1>(d, begin, end);
  } else if (d.ndim == 2) {
    copy_units<T, 2>(d, begin, end);
  } else {
    copy_units<T, 0>(d, begin, end);
  }
}

// Block b copies tile b - first_tile[i] of descriptor i (the last i with first_tile[i] <= b).
__global__ void multi_copy_kernel(const Desc* descs, const int64_t* first_tile, int n) {
  __shared__ Desc d;
  __shared__ int which;
  const int64_t tile = blockIdx.x;
  if (threadIdx.x == 0) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (first_tile[mid] <= tile) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    which = lo;
  }
  __syncthreads();
  const auto* from = reinterpret_cast<const int64_t*>(descs + which);
  auto* to = reinterpret_cast<int64_t*>(&d);
  constexpr int kWords = static_cast<int>(sizeof(Desc) / 8);
  for (int k = threadIdx.x; k < kWords; k += blockDim.x) to[k] = from[k];
  __syncthreads();
  const int64_t begin = (tile - first_tile[which]) * kTileUnits;
  const int64_t end = min(begin + kTileUnits, d.numel);
  switch (d.width) {
    case 1: copy_tile<uint8_t>(d, begin, end); break;
    case 2: copy_tile<uint16_t>(d, begin, end); break;
    case 4: copy_tile<uint32_t>(d, begin, end); break;
    case 8: copy_tile<uint64_t>(d, begin, end); break;
    default: copy_tile<uint4>(d, begin, end); break;
  }
}

struct Dim {
  int64_t size, ss, ds;
};

bool aligned(const void* p, int64_t w) { return reinterpret_cast<uintptr_t>(p) % w == 0; }

// Drops size-1 dims, orders by destination stride, merges contiguous runs, and picks the widest
// unit the layout and alignment allow. False when more than kMaxDims dims remain. numel > 0.
bool make_desc(const CopySpec& s, Desc& d) {
  TORCH_CHECK(
      s.itemsize == 1 || s.itemsize == 2 || s.itemsize == 4 || s.itemsize == 8 || s.itemsize == 16,
      "fastdp: unsupported element size ", s.itemsize);
  std::vector<Dim> dims;
  for (size_t k = 0; k < s.sizes.size(); ++k) {
    if (s.sizes[k] != 1) dims.push_back({s.sizes[k], s.src_strides[k], s.dst_strides[k]});
  }
  int64_t unit = s.itemsize;
  while (unit > 1 && !(aligned(s.src, unit) && aligned(s.dst, unit))) unit /= 2;
  if (unit < s.itemsize) {  // a misaligned element is copied as several smaller units
    const int64_t k = s.itemsize / unit;
    for (Dim& x : dims) x = {x.size, x.ss * k, x.ds * k};
    dims.push_back({k, 1, 1});
  }
  std::stable_sort(dims.begin(), dims.end(),
                   [](const Dim& a, const Dim& b) { return a.ds > b.ds; });
  std::vector<Dim> merged;
  for (const Dim& x : dims) {
    if (!merged.empty() && merged.back().ss == x.size * x.ss && merged.back().ds == x.size * x.ds) {
      merged.back() = {merged.back().size * x.size, x.ss, x.ds};
    } else {
      merged.push_back(x);
    }
  }
  if (merged.empty()) merged.push_back({1, 1, 1});
  for (int64_t w = 16; w > unit && merged.back().ss == 1 && merged.back().ds == 1; w /= 2) {
    const int64_t k = w / unit;
    bool ok = merged.back().size % k == 0 && aligned(s.src, w) && aligned(s.dst, w);
    for (size_t j = 0; ok && j + 1 < merged.size(); ++j) {
      ok = merged[j].ss % k == 0 && merged[j].ds % k == 0;
    }
    if (!ok) continue;
    for (size_t j = 0; j + 1 < merged.size(); ++j) {
      merged[j] = {merged[j].size, merged[j].ss / k, merged[j].ds / k};
    }
    merged.back().size /= k;
    unit = w;
    break;
  }
  if (merged.size() > static_cast<size_t>(kMaxDims)) return false;
  std::memset(&d, 0, sizeof(Desc));
  d.src = static_cast<const char*>(s.src);
  d.dst = static_cast<char*>(s.dst);
  d.ndim = static_cast<int32_t>(merged.size());
  d.width = static_cast<int32_t>(unit);
  d.numel = 1;
  for (size_t j = 0; j < merged.size(); ++j) {
    d.sizes[j] = merged[j].size;
    d.src_strides[j] = merged[j].ss;
    d.dst_strides[j] = merged[j].ds;
    d.numel *= merged[j].size;
  }
  return true;
}

}  // namespace

std::vector<size_t> multi_copy(const std::vector<CopySpec>& specs,
                               const c10::cuda::CUDAStream& stream) {
  std::vector<size_t> rejected;
  std::vector<Desc> descs;
  std::vector<int64_t> first_tile;
  int64_t tiles = 0;
  descs.reserve(specs.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    Desc d;
    bool empty = false;
    for (int64_t n : specs[k].sizes) empty = empty || n == 0;
    if (empty) continue;
    if (!make_desc(specs[k], d)) {
      rejected.push_back(k);
      continue;
    }
    descs.push_back(d);
    first_tile.push_back(tiles);
    tiles += (d.numel + kTileUnits - 1) / kTileUnits;
  }
  if (descs.empty()) return rejected;
  TORCH_CHECK(tiles < (int64_t{1} << 31), "fastdp: multi_copy of ", tiles, " tiles is too large");
  const size_t desc_bytes = descs.size() * sizeof(Desc);
  const size_t meta_bytes = desc_bytes + first_tile.size() * sizeof(int64_t);
  std::vector<char> host(meta_bytes);
  std::memcpy(host.data(), descs.data(), desc_bytes);
  std::memcpy(host.data() + desc_bytes, first_tile.data(), first_tile.size() * sizeof(int64_t));

  c10::cuda::CUDAStreamGuard guard(stream);  // device and stream the metadata is allocated for
  c10::DataPtr meta = c10::cuda::CUDACachingAllocator::get()->allocate(meta_bytes);
  PinnedBlock block = pinned_acquire(meta_bytes, stream);
  TORCH_CHECK(block || !stream_capturing(stream), "fastdp: a copy kernel captured into a CUDA ",
              "graph needs a pinned block for its metadata and the pinned pool has none left ",
              "(FASTDP_PINNED_POOL_MB); raise it, or set FASTDP_DISABLE_EXT=1 for torch's copies");
  const void* up = host.data();  // pageable fallback: the driver copies it out before returning
  if (block) {
    std::memcpy(block.data(), host.data(), meta_bytes);
    up = block.data();
  }
  C10_CUDA_CHECK(cudaMemcpyAsync(meta.get(), up, meta_bytes, cudaMemcpyHostToDevice, stream));
  if (block) block.record(stream);
  const auto* dev_descs = static_cast<const Desc*>(meta.get());
  const auto* dev_tiles =
      reinterpret_cast<const int64_t*>(static_cast<char*>(meta.get()) + desc_bytes);
  multi_copy_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(
      dev_descs, dev_tiles, static_cast<int>(descs.size()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return rejected;
}

}  // namespace fastdp
