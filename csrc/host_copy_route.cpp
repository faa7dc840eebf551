#include "host_copy_route.h"

#include <algorithm>
#include <numeric>

namespace fastdp {
namespace {

// Dims of size > 1, outermost destination dim first.
std::vector<size_t> outer_first(const std::vector<int64_t>& sizes,
                                const std::vector<int64_t>& dst_strides,
                                const std::vector<int64_t>& src_strides) {
  std::vector<size_t> dims;
  for (size_t k = 0; k < sizes.size(); ++k) {
    if (sizes[k] > 1) dims.push_back(k);
  }
  std::stable_sort(dims.begin(), dims.end(), [&](size_t a, size_t b) {
    if (dst_strides[a] != dst_strides[b]) return dst_strides[a] > dst_strides[b];
    return src_strides[a] > src_strides[b];
  });
  return dims;
}

struct Level {
  int64_t size, s, d;  // strides in bytes
};

}  // namespace

HostCopyRoute route_host_copy(const std::vector<int64_t>& sizes,
                              const std::vector<int64_t>& src_strides,
                              const std::vector<int64_t>& dst_strides, int64_t itemsize,
                              int64_t max_pitch) {
  HostCopyRoute p;
  int64_t numel = 1, span = itemsize;
  for (size_t k = 0; k < sizes.size(); ++k) {
    numel *= sizes[k];
    if (sizes[k] > 0) span += (sizes[k] - 1) * src_strides[k] * itemsize;
  }
  const int64_t nbytes = numel * itemsize;
  p.width = nbytes;
  p.span = nbytes == 0 ? 0 : span;
  if (nbytes == 0) return p;
  // Innermost level first; the contiguous run grows while both layouts continue it, and a level
  // adjacent to the previous one in both layouts merges into it.
  const std::vector<size_t> dims = outer_first(sizes, dst_strides, src_strides);
  int64_t width = itemsize;
  std::vector<Level> levels;
  for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
    const Level l{sizes[*it], src_strides[*it] * itemsize, dst_strides[*it] * itemsize};
    if (levels.empty() && l.s == width && l.d == width) {
      width *= l.size;
    } else if (!levels.empty() && l.s == levels.back().size * levels.back().s &&
               l.d == levels.back().size * levels.back().d) {
      levels.back().size *= l.size;
    } else {
      levels.push_back(l);
    }
  }
  p.width = width;
  if (levels.empty()) return p;  // kDense
  // The innermost level is a 2-D copy's pitch only where its source rows are apart: a stride of 0
  // (an expanded level) or below the width (overlapping rows, unfold) is no pitch a 2-D copy takes.
  const Level& l0 = levels[0];
  const bool pitched = l0.s >= width;
  const bool fits = pitched && l0.s <= max_pitch && l0.d <= max_pitch;
  const bool wide = width >= kMin2DRowBytes;
  if (levels.size() == 1 && fits && wide) {
    p.kind = HostCopyRoute::k2D;
    p.height = l0.size;
    p.spitch = l0.s;
    p.dpitch = l0.d;
    return p;
  }
  if ((!wide || !pitched || levels.size() > 1) && span <= kMaxSpanRatio * nbytes) {
    p.kind = HostCopyRoute::kSpan;
    return p;
  }
  // Rows: a 2-D copy of the innermost level per outer index; rows one by one (height 1) where it
  // is no pitch or one above the device's maximum.
  const size_t first_outer = fits ? 1 : 0;
  if (fits) {
    p.height = l0.size;
    p.spitch = l0.s;
    p.dpitch = l0.d;
  }
  for (size_t k = levels.size(); k-- > first_outer;) {
    p.outer_sizes.push_back(levels[k].size);
    p.outer_sstrides.push_back(levels[k].s);
    p.outer_dstrides.push_back(levels[k].d);
  }
  p.kind = p.outer_sizes.empty() ? HostCopyRoute::k2D : HostCopyRoute::kRows;
  return p;
}

StageRows stage_rows(const std::vector<int64_t>& sizes, const std::vector<int64_t>& dst_strides,
                     int64_t itemsize, int64_t window) {
  StageRows r;
  r.bytes = std::accumulate(sizes.begin(), sizes.end(), itemsize, std::multiplies<int64_t>());
  const std::vector<size_t> dims = outer_first(sizes, dst_strides, dst_strides);
  for (size_t j = 0; j < dims.size(); ++j) {
    const int64_t k = static_cast<int64_t>(dims[j]);
    const int64_t row = dst_strides[k] * itemsize;
    if (window <= 0 || row <= window || j + 1 == dims.size()) {
      r.dim = k;
      r.count = sizes[k];
      r.bytes = row;
      return r;
    }
    r.outer.push_back(k);
  }
  return r;
}

}  // namespace fastdp
