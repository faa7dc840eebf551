#pragma once
// One kernel launch that copies any number of strided tensors (any dtype, any layout) on a device:
// the pack step of scatter and the slice writes of gather.

#include <c10/cuda/CUDAStream.h>
#include <c10/util/ArrayRef.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fastdp {

// Copy of one tensor's elements, byte for byte: `sizes` elements of `itemsize` bytes each, read at
// src + sum(i_k * src_strides[k]) * itemsize and written at the same index through dst_strides.
// The ArrayRefs must outlive the multi_copy call.
struct CopySpec {
  const void* src;
  void* dst;
  int64_t itemsize;
  c10::IntArrayRef sizes;
  c10::IntArrayRef src_strides;
  c10::IntArrayRef dst_strides;
};

// Enqueues every spec on `stream` as one kernel launch (dtype-agnostic: 1- to 16-byte units,
// widened to 16-byte vectors where layout and alignment allow). All pointers are on the stream's
// device; destinations must not overlap. Returns the indices of the specs it did not take (more
// than 8 dimensions left after merging); the caller copies those another way.
std::vector<size_t> multi_copy(const std::vector<CopySpec>& specs,
                               const c10::cuda::CUDAStream& stream);

}  // namespace fastdp
