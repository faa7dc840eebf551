#include "cuda/pinned_pool.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <memory>
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

// A graph's user object's destructor: on a CUDA thread, so it calls no CUDA API (nor throws).
void CUDART_CB run_graph_return(void* r) {
  const std::unique_ptr<Pool::GraphReturn> owned(static_cast<Pool::GraphReturn*>(r));
  (*owned)();
}

// Gives `r` to `graph`, being captured, as a user object that CUDA destroys once the graph and
// every executable made from it are destroyed and their launches done. One user object per
// capturing acquire, not per capture: no registry of captures and of when each ends; a capture
// makes few acquires, once. Without a graph (an invalidated capture runs nothing) or when CUDA
// refuses, the hold ends now (nothing captured reads the block yet) and the error is raised.
void hand_to_graph(Pool::GraphReturn r, cudaGraph_t graph) {
  if (graph == nullptr) return r();
  auto owned = std::make_unique<Pool::GraphReturn>(std::move(r));
  c10::cuda::CUDAStreamCaptureModeGuard relaxed{cudaStreamCaptureModeRelaxed};
  cudaUserObject_t object = nullptr;
  cudaError_t err = cudaUserObjectCreate(&object, owned.get(), run_graph_return, 1,
                                         cudaUserObjectNoDestructorSync);
  if (err != cudaSuccess) (*owned)();
  C10_CUDA_CHECK(err);
  owned.release();  // run_graph_return deletes it
  err = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
  if (err != cudaSuccess) C10_CUDA_CHECK_WARN(cudaUserObjectRelease(object));  // runs it
  C10_CUDA_CHECK(err);
}

// The capture status of `stream` and, while a capture is active, its graph.
cudaGraph_t capture_graph(const c10::cuda::CUDAStream& stream, cudaStreamCaptureStatus* status) {
  cudaGraph_t graph = nullptr;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, status, nullptr, &graph));
#else
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo_v2(stream, status, nullptr, &graph));
#endif
  return *status == cudaStreamCaptureStatusActive ? graph : nullptr;
}

}  // namespace

PinnedBlock& PinnedBlock::operator=(PinnedBlock&& other) noexcept {
  if (this != &other) {
    reset();
    state_ = std::exchange(other.state_, nullptr);
    captured_ = other.captured_;
  }
  return *this;
}

void* PinnedBlock::data() const { return state_->ptr; }

size_t PinnedBlock::size() const { return state_->size; }

void PinnedBlock::record(const c10::cuda::CUDAStream& stream) {
  if (captured_) return;  // held by its graph: NOTE [ Pinned blocks and graphs ]
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
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaGraph_t graph = capture_graph(stream, &status);
  const bool capturing = status != cudaStreamCaptureStatusNone;
  Pool::Block* b = pool().acquire(bytes, capturing);
  PinnedBlock block(b, capturing);  // back to the pool if the hand-over throws
  if (b != nullptr && capturing) hand_to_graph(pool().graph_return(b), graph);
  return block;
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
