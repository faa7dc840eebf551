#include "cuda/pinned_pool.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <list>
#include <mutex>
#include <optional>

// NOTE [ Pinned staging ]
// An H2D copy from pageable memory blocks the host and is staged by the driver per tensor (torch's
// per-leaf `.to(device)`); fastdp packs host chunks into pinned blocks, a window each, and issues
// one cudaMemcpyAsync per window. The pool is fastdp's, not torch's CachingHostAllocator (which
// keeps every block until empty_cache() and is shared with the user's pin_memory(), so it has no
// bound): FASTDP_PINNED_POOL_MB caps it (default 256; 0 turns staging off), and a request above
// the cap gets an empty handle (the caller copies unstaged). A block is lent again only once the
// events its streams recorded (PinnedBlock::record) completed, so no pending copy's bytes are
// overwritten; at capacity the pool waits on the oldest block's events, never a device sync.
// The pool is leaked at exit: cudaFreeHost after the CUDA runtime shut down crashes.

namespace fastdp {

struct PinnedBlockState {
  void* ptr = nullptr;
  size_t size = 0;
  bool lent = false;
  uint64_t released_at = 0;
  // A list: erasing from a vector move-assigns the survivors, and c10's CUDAEvent move-assign
  // overwrites its event without destroying it (every completed event leaked).
  std::list<at::cuda::CUDAEvent> events;
};

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

// 1 MiB steps, powers of two from 64 KiB below: steps with the same shapes reuse their blocks.
size_t rounded(size_t bytes) {
  if (bytes >= kMiB) return (bytes + kMiB - 1) / kMiB * kMiB;
  size_t r = size_t{64} << 10;
  while (r < bytes) r <<= 1;
  return r;
}

// Whether every event recorded on the block completed; drops those that did.
bool idle(PinnedBlockState& b) {
  if (b.lent) return false;
  b.events.remove_if([](const at::cuda::CUDAEvent& e) { return e.query(); });
  return b.events.empty();
}

class Pool {
 public:
  PinnedBlockState* acquire(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes == 0 || bytes > capacity_) return nullptr;
    for (;;) {
      PinnedBlockState* best = nullptr;
      for (auto& b : blocks_) {
        if (b->size >= bytes && (best == nullptr || b->size < best->size) && idle(*b)) {
          best = b.get();
        }
      }
      if (best != nullptr) {
        best->lent = true;
        return best;
      }
      const size_t want = std::max(bytes, std::min(rounded(bytes), capacity_));
      while (reserved_ + want > capacity_ && free_one_idle()) {
      }
      if (reserved_ + want <= capacity_) return allocate(want);
      PinnedBlockState* oldest = nullptr;
      for (auto& b : blocks_) {
        if (!b->lent && !b->events.empty() &&
            (oldest == nullptr || b->released_at < oldest->released_at)) {
          oldest = b.get();
        }
      }
      if (oldest == nullptr) return nullptr;  // everything is lent: do not wait on ourselves
      for (auto& e : oldest->events) e.synchronize();
      oldest->events.clear();
    }
  }

  void release(PinnedBlockState* b) {
    std::lock_guard<std::mutex> lock(mu_);
    b->lent = false;
    b->released_at = ++clock_;
    while (reserved_ > capacity_ && free_one_idle()) {
    }
  }

  std::vector<std::pair<std::string, int64_t>> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t lent = 0, in_flight = 0;
    for (auto& b : blocks_) {
      if (b->lent) {
        lent += static_cast<int64_t>(b->size);
      } else if (!idle(*b)) {
        in_flight += static_cast<int64_t>(b->size);
      }
    }
    return {{"capacity", static_cast<int64_t>(capacity_)},
            {"reserved", static_cast<int64_t>(reserved_)},
            {"lent", lent},
            {"in_flight", in_flight},
            {"blocks", static_cast<int64_t>(blocks_.size())},
            {"allocations", allocations_}};
  }

  int64_t set_capacity(int64_t bytes) {
    TORCH_CHECK(bytes >= 0, "fastdp.pinned_pool_set_capacity: expected bytes >= 0, got ", bytes);
    std::lock_guard<std::mutex> lock(mu_);
    const size_t prev = capacity_;
    capacity_ = static_cast<size_t>(bytes);
    while (reserved_ > capacity_ && free_one_idle()) {
    }
    return static_cast<int64_t>(prev);
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mu_);
    while (free_one_idle()) {
    }
  }

  size_t capacity() {
    std::lock_guard<std::mutex> lock(mu_);
    return capacity_;
  }

 private:
  PinnedBlockState* allocate(size_t bytes) {
    void* ptr = nullptr;
    // Portable: any device's copy may use the block.
    const cudaError_t err = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // out of pinned memory: the caller takes the unstaged path
      return nullptr;
    }
    auto b = std::make_unique<PinnedBlockState>();
    b->ptr = ptr;
    b->size = bytes;
    b->lent = true;
    reserved_ += bytes;
    ++allocations_;
    blocks_.push_back(std::move(b));
    return blocks_.back().get();
  }

  // cudaFreeHost synchronises implicitly: blocks are freed only when the capacity forces it or on
  // empty_cache().
  bool free_one_idle() {
    for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
      if (idle(**it)) {
        C10_CUDA_CHECK_WARN(cudaFreeHost((*it)->ptr));
        reserved_ -= (*it)->size;
        blocks_.erase(it);
        return true;
      }
    }
    return false;
  }

  std::mutex mu_;
  size_t capacity_ = capacity_from_env();
  size_t reserved_ = 0;
  int64_t allocations_ = 0;
  uint64_t clock_ = 0;
  std::vector<std::unique_ptr<PinnedBlockState>> blocks_;
};

Pool& pool() {
  static Pool* p = new Pool();  // leaked on purpose: see NOTE [ Pinned staging ]
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
  at::cuda::CUDAEvent event;
  event.record(stream);
  state_->events.push_back(std::move(event));
}

void PinnedBlock::reset() {
  if (state_ != nullptr) pool().release(std::exchange(state_, nullptr));
}

PinnedBlock pinned_acquire(size_t bytes) { return PinnedBlock(pool().acquire(bytes)); }

std::vector<std::pair<std::string, int64_t>> pinned_pool_stats() { return pool().stats(); }

int64_t pinned_pool_set_capacity(int64_t bytes) { return pool().set_capacity(bytes); }

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

size_t staging_window(size_t total) { return staging_window_for(total, pool().capacity()); }

}  // namespace fastdp
