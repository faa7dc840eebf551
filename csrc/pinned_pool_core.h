#pragma once
// The pinned pool's bookkeeping as host code, independent of CUDA: size classes, per-class free
// lists, the capacity bound and event waits outside the lock. cuda/pinned_pool.cpp instantiates it
// with cudaHostAlloc and CUDA events; host_pool.h with malloc and flags, so a CPU build tests it.
// See NOTE [ Pinned staging ] in cuda/pinned_pool.cpp.

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace fastdp {

// The size class serving a request of `bytes` (0 < bytes <= capacity): the smallest power of two
// from 64 KiB up that holds it, capped at the capacity. Steps of the same shapes ask the same
// classes, so their blocks are reused and nothing is allocated after the first step.
inline size_t pinned_size_class(size_t bytes, size_t capacity) {
  size_t c = size_t{64} << 10;
  while (c < bytes) c <<= 1;
  return c < capacity ? c : capacity;
}

// One pooled block. `events` are recorded by the block's holder while it is lent and read by the
// pool only while it is not. A list: erasing from a vector move-assigns the survivors, and c10's
// CUDAEvent move-assign overwrites its event without destroying it (every completed event leaked).
template <class Event>
struct PoolBlock {
  void* ptr = nullptr;
  size_t size = 0;
  bool lent = false;
  uint64_t released_at = 0;
  std::list<Event> events;
};

// Backend: `using Event`; static void* alloc(size_t) (nullptr on failure); static void
// free(void*); static bool done(Event&) (non-blocking); static void wait(Event&) (blocks).
template <class Backend>
class BlockPool {
 public:
  using Event = typename Backend::Event;
  using Block = PoolBlock<Event>;

  explicit BlockPool(size_t capacity) : capacity_(capacity) {}
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A lent block of at least `bytes`, or nullptr (bytes == 0 or above the capacity, out of
  // memory, or every block lent). Allocates only when no block of the class is idle and the
  // capacity has room; otherwise waits, without the lock, on the oldest in-flight block.
  Block* acquire(size_t bytes) {
    std::unique_lock<std::mutex> lock(mu_);
    if (bytes == 0 || bytes > capacity_) return nullptr;
    const size_t cls = pinned_size_class(bytes, capacity_);
    for (;;) {
      auto& list = by_class_[cls];
      for (Block* b : list) {
        if (!b->lent && idle(*b)) return lend(b);
      }
      std::vector<void*> freed;
      while (reserved_ + cls > capacity_ && take_idle_other_than(cls, freed)) {
      }
      if (reserved_ + cls <= capacity_) {
        reserved_ += cls;
        ++allocations_;
        lock.unlock();
        free_all(freed);
        void* ptr = Backend::alloc(cls);
        lock.lock();
        if (ptr == nullptr) {
          reserved_ -= cls;
          return nullptr;  // out of pinned memory: the caller takes the unstaged path
        }
        blocks_.push_back(std::make_unique<Block>());
        Block* b = blocks_.back().get();
        b->ptr = ptr;
        b->size = cls;
        list.push_back(b);
        return lend(b);
      }
      Block* oldest = oldest_in_flight(cls);
      if (oldest == nullptr) {
        lock.unlock();
        free_all(freed);
        return nullptr;  // every block is lent: never wait on ourselves
      }
      oldest->lent = true;  // nobody else waits on or lends it meanwhile
      std::list<Event> events = std::move(oldest->events);
      oldest->events.clear();
      ++waits_;
      lock.unlock();
      free_all(freed);
      for (Event& e : events) Backend::wait(e);
      events.clear();
      lock.lock();
      if (oldest->size == cls) return oldest;
      oldest->lent = false;  // idle now, of another class: freed by the next round if needed
    }
  }

  // Returns a lent block; its recorded events decide when it is lent again.
  void release(Block* b) {
    std::vector<void*> freed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      b->lent = false;
      b->released_at = ++clock_;
      while (reserved_ > capacity_ && take_idle_other_than(0, freed)) {
      }
    }
    free_all(freed);
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
            {"allocations", allocations_},
            {"frees", frees_},
            {"waits", waits_}};
  }

  // Sets the capacity, freeing idle blocks beyond it; returns the previous one.
  size_t set_capacity(size_t bytes) {
    std::vector<void*> freed;
    size_t prev;
    {
      std::lock_guard<std::mutex> lock(mu_);
      prev = capacity_;
      capacity_ = bytes;
      while (reserved_ > capacity_ && take_idle_other_than(0, freed)) {
      }
    }
    free_all(freed);
    return prev;
  }

  void empty_cache() {
    std::vector<void*> freed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (take_idle_other_than(0, freed)) {
      }
    }
    free_all(freed);
  }

  size_t capacity() {
    std::lock_guard<std::mutex> lock(mu_);
    return capacity_;
  }

 private:
  Block* lend(Block* b) {
    b->lent = true;
    return b;
  }

  // Whether every event recorded on the block completed; drops those that did.
  static bool idle(Block& b) {
    if (b.lent) return false;
    b.events.remove_if([](Event& e) { return Backend::done(e); });
    return b.events.empty();
  }

  Block* oldest_in_flight(size_t cls) {
    Block* same = nullptr;
    Block* any = nullptr;
    for (auto& b : blocks_) {
      if (b->lent || b->events.empty()) continue;
      if (b->size == cls && (same == nullptr || b->released_at < same->released_at)) same = b.get();
      if (any == nullptr || b->released_at < any->released_at) any = b.get();
    }
    return same != nullptr ? same : any;
  }

  // Unlinks one idle block whose size is not `keep` (0: any) and queues its memory in `freed`
  // (freed after the lock: freeing pinned memory synchronises the device).
  bool take_idle_other_than(size_t keep, std::vector<void*>& freed) {
    for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
      Block& b = **it;
      if ((keep != 0 && b.size == keep) || !idle(b)) continue;
      by_class_[b.size].remove(&b);
      reserved_ -= b.size;
      ++frees_;
      freed.push_back(b.ptr);
      blocks_.erase(it);
      return true;
    }
    return false;
  }

  static void free_all(std::vector<void*>& freed) {
    for (void* p : freed) Backend::free(p);
    freed.clear();
  }

  std::mutex mu_;
  size_t capacity_;
  size_t reserved_ = 0;
  int64_t allocations_ = 0, frees_ = 0, waits_ = 0;
  uint64_t clock_ = 0;
  std::vector<std::unique_ptr<Block>> blocks_;
  std::map<size_t, std::list<Block*>> by_class_;  // every block by size class, lent or not
};

}  // namespace fastdp
