#pragma once
// Pooled, bounded pinned host memory for staging copies, and each device's background copy stream.
// See NOTE [ Pinned staging ] in pinned_pool.cpp.

#include "cuda/torch_cuda_headers.h"  // first: see its comment

#include <c10/cuda/CUDAStream.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pinned_pool_core.h"
#include "transfer.h"

namespace fastdp {

using PinnedBlockState = PoolBlock<at::cuda::CUDAEvent>;

// A pinned host block lent by the pool. Move-only; returned to the pool on destruction. Copies that
// read or write it must be followed by record(stream) before the handle dies: the pool then lends
// the block again only once every recorded event completed. Empty (false) when the pool could not
// serve the request; callers then take an unstaged path.
class PinnedBlock {
 public:
  PinnedBlock() = default;
  PinnedBlock(PinnedBlockState* state, bool captured) : state_(state), captured_(captured) {}
  PinnedBlock(PinnedBlock&& other) noexcept
      : state_(std::exchange(other.state_, nullptr)), captured_(other.captured_) {}
  PinnedBlock& operator=(PinnedBlock&& other) noexcept;
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;
  ~PinnedBlock() { reset(); }

  explicit operator bool() const { return state_ != nullptr; }
  void* data() const;
  size_t size() const;
  // Marks the block in use by the work enqueued so far on `stream` (any device). Nothing for a
  // block lent during a capture (its graph holds it; no event is recorded during a capture).
  void record(const c10::cuda::CUDAStream& stream);
  // Returns the block to the pool now (after its recorded events, for reuse).
  void reset();

 private:
  PinnedBlockState* state_ = nullptr;
  bool captured_ = false;  // lent by a capturing acquire
};

// A block of at least `bytes` (> 0) bytes, of a fixed size class (pinned_size_class), for copies
// on `stream`. May wait on the oldest in-flight block when the pool is at capacity (an event wait
// outside the pool's lock, never a device sync). Empty when bytes exceed the capacity
// (FASTDP_PINNED_POOL_MB, default 256; 0 disables staging), every block is lent, or cudaHostAlloc
// runs out of memory (other CUDA errors throw). While `stream` is being captured into a CUDA
// graph that graph holds the block until it and its executables are destroyed: NOTE [ Pinned
// blocks and graphs ].
PinnedBlock pinned_acquire(size_t bytes, const c10::cuda::CUDAStream& stream);

// Whether `stream` is being captured into a CUDA graph.
bool stream_capturing(const c10::cuda::CUDAStream& stream);

// pinned_pool_stats, pinned_pool_set_capacity and pinned_pool_empty_cache: see transfer.h.

// The background stream of `device` that staged host-to-device copies run on (one per device,
// taken once from torch's stream pool, never the default stream).
c10::cuda::CUDAStream copy_stream(c10::DeviceIndex device);

// The pool's current capacity in bytes (0: staging off).
size_t pinned_pool_capacity();

// scatter_window_for(total, the pool's current capacity): see transfer.h.
size_t staging_window(size_t total);

}  // namespace fastdp
