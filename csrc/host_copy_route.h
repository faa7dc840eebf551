#pragma once
// The host-side decisions of copies from host memory to a GPU, pure and compiled in every build
// (tested on the CPU through fastdp._C._host_copy_route and _C._stage_rows): how a pinned chunk is
// copied without a host temporary, and which rows a pageable chunk is staged by.
// See NOTE [ Stream order of host copies ] in cuda/scatter_host_cuda.cu.

#include <cstdint>
#include <vector>

namespace fastdp {

// Rows narrower than this many bytes are not sent by a 2-D copy (the copy engine moves each row
// as a transfer of its own); a span copy serves them (quick check: copy_shapes_perf).
constexpr int64_t kMin2DRowBytes = 256;
// A span copy moves at most this many times the chunk's bytes.
constexpr int64_t kMaxSpanRatio = 4;

// How a pinned chunk (`sizes`, `src_strides` in elements, strides >= 0) reaches its dense region
// (`dst_strides`), each way an asynchronous DMA on the stream that reads it, so a source still
// being written on that stream is read after the write:
//   kDense  one copy of `width` bytes;
//   k2D     one 2-D copy: `height` rows of `width` bytes, `spitch` and `dpitch` apart (both at
//           least `width`: a source level of stride 0 or overlapping rows is never a pitch);
//   kRows   per index of the `outer` levels, one 2-D copy as k2D (or, `height` == 1, a plain copy
//           of `width` bytes): for pitches above `max_pitch`, no pitch, or a span too wide;
//   kSpan   the `span` source bytes (from the chunk's first element) in one copy to a device
//           scratch, then a device copy into the region: narrow rows, several strided levels,
//           expanded or overlapping rows (the span is then at most the chunk's bytes).
struct HostCopyRoute {
  enum Kind { kDense, k2D, kRows, kSpan } kind = kDense;
  int64_t width = 0, height = 1, spitch = 0, dpitch = 0;  // bytes
  int64_t span = 0;                                       // bytes
  // kRows: the levels iterated around the 2-D copy, outermost first (bytes).
  std::vector<int64_t> outer_sizes, outer_sstrides, outer_dstrides;
};

// The route of a chunk of `itemsize`-byte elements; `max_pitch`: the device's largest pitch of a
// 2-D copy (cudaDevAttrMaxPitch). Dims of size 1 are ignored and dims that are adjacent in both
// layouts merged, so most slices and channels_last chunks are one 2-D copy.
HostCopyRoute route_host_copy(const std::vector<int64_t>& sizes,
                              const std::vector<int64_t>& src_strides,
                              const std::vector<int64_t>& dst_strides, int64_t itemsize,
                              int64_t max_pitch);

// The rows a pageable chunk is staged by: `dim`, the outermost destination dim (strides
// `dst_strides`, dense) whose one index (`bytes`, every inner element) fits `window`, cut into
// ranges of rows; the dims outer to it (`outer`, outermost first, size > 1) are walked one index
// at a time. dim < 0: the chunk is a single row. window 0 (staging off): the outermost dim.
struct StageRows {
  int64_t dim = -1, count = 1, bytes = 0;
  std::vector<int64_t> outer;
};
StageRows stage_rows(const std::vector<int64_t>& sizes, const std::vector<int64_t>& dst_strides,
                     int64_t itemsize, int64_t window);

}  // namespace fastdp
