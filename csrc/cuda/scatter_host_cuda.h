#pragma once
// Host chunks to one GPU, for scatter_cuda: pinned chunks by DMA on the current stream, pageable
// chunks packed into pinned windows. See NOTE [ Stream order of host copies ].

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fastdp {

// One chunk that must be copied: its source view, its destination strides and region.
struct ChunkCopy {
  size_t r, i;                   // replica and leaf: its place in the result
  at::Tensor chunk;              // the source view
  std::vector<int64_t> strides;  // strides torch's .to() gives it
  int64_t offset = 0;            // byte offset of its region in the destination buffer
  int64_t nbytes = 0;
};

// Gives each chunk its region, aligned to kRegionAlign, from byte `start`; returns the end.
int64_t lay_out(const std::vector<ChunkCopy*>& copies, int64_t start);

// Pinned chunks -> `device`: result[r][i] becomes a view into one new buffer on `device`,
// written by DMAs on its current stream (captured into a graph when that stream is capturing).
void scatter_pinned(const std::vector<ChunkCopy*>& copies, c10::DeviceIndex device,
                    std::vector<std::vector<at::Tensor>>& result);

// Pageable chunks -> `device`, as scatter_pinned; packed into pinned windows and sent on the
// device's copy stream, which the current stream waits on. Raises under graph capture.
void scatter_pageable(const std::vector<ChunkCopy*>& copies, c10::DeviceIndex device,
                      std::vector<std::vector<at::Tensor>>& result);

}  // namespace fastdp
