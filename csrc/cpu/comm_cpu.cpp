#include "cpu/comm_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace fastdp {

namespace {

constexpr int64_t kCopyGrainBytes = int64_t{1} << 19;  // 512 KiB per task: memcpy-bound
constexpr int64_t kReduceGrain = int64_t{1} << 15;     // elements per task
constexpr int64_t kBlock = 2048;  // elements of the output kept in L1 across the adds

struct Segment {
  const char* src;
  char* dst;
  int64_t nbytes;
};

// memcpy of every segment, split by bytes over the intra-op threads whatever the segment sizes.
void parallel_memcpy(const std::vector<Segment>& segs) {
  std::vector<int64_t> start(segs.size() + 1, 0);
  for (size_t i = 0; i < segs.size(); ++i) start[i + 1] = start[i] + segs[i].nbytes;
  const int64_t total = start.back();
  if (total == 0) return;
  at::parallel_for(0, total, kCopyGrainBytes, [&](int64_t begin, int64_t end) {
    // Segments are non-empty, so `start` is strictly increasing.
    size_t i = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    while (begin < end) {
      const int64_t stop = std::min(end, start[i + 1]);
      const int64_t off = begin - start[i];
      std::memcpy(segs[i].dst + off, segs[i].src + off, static_cast<size_t>(stop - begin));
      begin = stop;
      ++i;
    }
  });
}

// out[0:m] = p[0] + p[1] + ... in list order, rounded to T after every add (p.size() >= 2).
template <typename T>
void sum_range(T* out, const std::vector<const T*>& p, int64_t m) {
  for (int64_t b0 = 0; b0 < m; b0 += kBlock) {
    const int64_t len = std::min(kBlock, m - b0);
    T* o = out + b0;
    const T* x0 = p[0] + b0;
    const T* x1 = p[1] + b0;
    for (int64_t e = 0; e < len; ++e) o[e] = static_cast<T>(x0[e] + x1[e]);
    for (size_t i = 2; i < p.size(); ++i) {
      const T* x = p[i] + b0;
      for (int64_t e = 0; e < len; ++e) o[e] = static_cast<T>(o[e] + x[e]);
    }
  }
}

template <typename T>
void reduce_bucket(const std::vector<std::vector<at::Tensor>>& inputs, const Bucket& b, T* out) {
  // Non-empty segments of the bucket, with a pointer per input list for each.
  const size_t n = inputs.size();
  std::vector<int64_t> lo, hi;
  std::vector<const T*> table;
  for (size_t s = 0; s < b.index.size(); ++s) {
    const int64_t numel = inputs[0][b.index[s]].numel();
    if (numel == 0) continue;
    lo.push_back(b.offset[s]);
    hi.push_back(b.offset[s] + numel);
    for (size_t i = 0; i < n; ++i) table.push_back(inputs[i][b.index[s]].const_data_ptr<T>());
  }
  if (lo.empty()) return;
  at::parallel_for(0, b.numel, kReduceGrain, [&](int64_t begin, int64_t end) {
    std::vector<const T*> p(n);
    size_t s = std::upper_bound(lo.begin(), lo.end(), begin) - lo.begin() - 1;
    while (begin < end) {
      const int64_t stop = std::min(end, hi[s]);
      for (size_t i = 0; i < n; ++i) p[i] = table[s * n + i] + (begin - lo[s]);
      sum_range(out + begin, p, stop - begin);
      begin = stop;
      ++s;
    }
  });
}

}  // namespace

void broadcast_flat_cpu(at::TensorList srcs, const std::vector<Bucket>& buckets,
                        const std::vector<std::vector<at::Tensor>>& dsts) {
  std::vector<Segment> segs;
  for (size_t k = 0; k < dsts.size(); ++k) {
    for (size_t b = 0; b < buckets.size(); ++b) {
      const auto& bucket = buckets[b];
      char* base = static_cast<char*>(dsts[k][b].mutable_data_ptr());
      const int64_t item = static_cast<int64_t>(c10::elementSize(bucket.dtype));
      for (size_t s = 0; s < bucket.index.size(); ++s) {
        const auto& src = srcs[bucket.index[s]];
        const int64_t nbytes = static_cast<int64_t>(src.nbytes());
        if (nbytes == 0) continue;
        segs.push_back({static_cast<const char*>(src.const_data_ptr()),
                        base + bucket.offset[s] * item, nbytes});
      }
    }
  }
  parallel_memcpy(segs);
}

std::vector<std::pair<size_t, size_t>> copy_into_cpu(
    at::TensorList srcs, const std::vector<std::vector<at::Tensor>>& outs) {
  std::vector<Segment> segs;
  std::vector<std::pair<size_t, size_t>> strided;
  for (size_t k = 0; k < outs.size(); ++k) {
    for (size_t j = 0; j < srcs.size(); ++j) {
      const int64_t nbytes = static_cast<int64_t>(srcs[j].nbytes());
      if (nbytes == 0) continue;
      const auto& out = outs[k][j];
      if (!flat_copyable(out)) {
        strided.emplace_back(k, j);
        continue;
      }
      segs.push_back({static_cast<const char*>(srcs[j].const_data_ptr()),
                      static_cast<char*>(out.mutable_data_ptr()), nbytes});
    }
  }
  parallel_memcpy(segs);
  return strided;
}

std::vector<at::Tensor> reduce_flat_cpu(const std::vector<std::vector<at::Tensor>>& inputs,
                                        const std::vector<Bucket>& buckets) {
  std::vector<at::Tensor> flats;
  flats.reserve(buckets.size());
  for (const auto& b : buckets) {
    auto flat = at::empty({b.numel}, at::TensorOptions().dtype(b.dtype).device(at::kCPU));
    AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND3(
        at::kHalf, at::kBFloat16, at::kBool, b.dtype, "fastdp.reduce_add_coalesced", [&] {
          reduce_bucket<scalar_t>(inputs, b, flat.mutable_data_ptr<scalar_t>());
        });
    flats.push_back(std::move(flat));
  }
  return flats;
}

}  // namespace fastdp
