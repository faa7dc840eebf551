#include "cuda/pinned_pool.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <mutex>
#include <optional>

// NOTE [ Pinned staging ]
// Pageable host chunks bound for a GPU are packed into pinned blocks, a window each, and sent by
// one cudaMemcpyAsync per window; pinned sources are never staged. The pool is fastdp's, not
// torch's CachingHostAllocator (which keeps every block until empty_cache() and is shared with the
// user's pin_memory(), so it has no bound): FASTDP_PINNED_POOL_MB caps it (0 turns staging off).
// Blocks come in fixed size classes (pinned_pool_core.h), so repeated steps reuse them:
// cudaHostAlloc only while warming up, cudaFreeHost (an implicit device sync) only when the
// capacity forces it or on empty_cache(), both outside the lock. A block is lent again once the
// events its streams recorded completed; at capacity the pool waits on the oldest block's events,
// also outside the lock. The pool is leaked at exit: cudaFreeHost after runtime shutdown crashes.
// Under graph capture: NOTE [ Pinned blocks and graphs ] in pinned_pool_core.h.

namespace fastdp {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

size_t capacity_from_env() {
  const char* env = std::getenv("FASTDP_PINNED_POOL_MB");
  if (env == nullptr || *env == '\0') return 256 * kMiB;
  char* end = nullptr;
  const long long mb = std::strtoll(env, &end, 10);
  TORCH_CHECK(end != env && *end == '\0' && mb >= 0,
              "fastdp: FASTDP_PINNED_POOL_MB must be a non-negative integer, got '", env, "'");
  return static_cast<size_t>(mb) * kMiB;
}

// Every call under a relaxed capture mode, as torch's host allocator makes them: a capture in
// global mode (on this thread or another) forbids cudaHostAlloc and event queries and waits
// otherwise. None of them is part of a graph: a capturing acquire allocates a block the graph
// holds and queries nothing (NOTE [ Pinned blocks and graphs ]).
struct CudaHostBackend {
  using Event = at::cuda::CUDAEvent;
  using Relaxed = c10::cuda::CUDAStreamCaptureModeGuard;
  void* alloc(size_t bytes) {
    Relaxed relaxed{cudaStreamCaptureModeRelaxed};
    void* ptr = nullptr;
    // Portable: any device's copy may use the block.
    const cudaError_t err = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // out of pinned memory only: the caller takes the unstaged path
      return nullptr;
    }
    C10_CUDA_CHECK(err);  // any other error (an earlier fault, a broken capture) is the caller's
    return ptr;
  }
  void free(void* p) { C10_CUDA_CHECK_WARN(cudaFreeHost(p)); }
  bool done(Event& e) {
    Relaxed relaxed{cudaStreamCaptureModeRelaxed};
    return e.query();
  }
  void wait(Event& e) {
    Relaxed relaxed{cudaStreamCaptureModeRelaxed};
    e.synchronize();
  }
};

using Pool = BlockPool<CudaHostBackend>;

Pool& pool() {
  static Pool* p = new Pool(capacity_from_env());  // leaked on purpose: NOTE [ Pinned staging ]
  return *p;
}

}  // namespace

PinnedBlock& PinnedBlock::operator=(PinnedBlock&& other) noexcept {
  if (this != &other) {
    reset();
    state_ = std::exchange(other.state_, nullptr);
  }
  return *this;
}

void* PinnedBlock::data() const { return state_->ptr; }

size_t PinnedBlock::size() const { return state_->size; }

void PinnedBlock::record(const c10::cuda::CUDAStream& stream) {
  if (state_->graph) return;  // held by a graph for good: NOTE [ Pinned blocks and graphs ]
  at::cuda::CUDAEvent event;
  event.record(stream);
  state_->events.push_back(std::move(event));
}

void PinnedBlock::reset() {
  if (state_ != nullptr) pool().release(std::exchange(state_, nullptr));
}

bool stream_capturing(const c10::cuda::CUDAStream& stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

PinnedBlock pinned_acquire(size_t bytes, const c10::cuda::CUDAStream& stream) {
  return PinnedBlock(pool().acquire(bytes, stream_capturing(stream)));
}

std::vector<std::pair<std::string, int64_t>> pinned_pool_stats() { return pool().stats(); }

int64_t pinned_pool_set_capacity(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "fastdp.pinned_pool_set_capacity: expected bytes >= 0, got ", bytes);
  return static_cast<int64_t>(pool().set_capacity(static_cast<size_t>(bytes)));
}

void pinned_pool_empty_cache() { pool().empty_cache(); }

c10::cuda::CUDAStream copy_stream(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::vector<std::optional<c10::cuda::CUDAStream>> streams;
  std::lock_guard<std::mutex> lock(mu);
  if (streams.empty()) streams.resize(c10::cuda::device_count());
  TORCH_CHECK(device >= 0 && device < static_cast<c10::DeviceIndex>(streams.size()),
              "fastdp: invalid CUDA device index ", static_cast<int>(device));
  if (!streams[device]) streams[device] = c10::cuda::getStreamFromPool(false, device);
  return *streams[device];
}

size_t pinned_pool_capacity() { return pool().capacity(); }

size_t staging_window(size_t total) { return scatter_window_for(total, pool().capacity()); }

}  // namespace fastdp
