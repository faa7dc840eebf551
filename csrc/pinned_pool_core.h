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

// The size class serving a request of `bytes` (0 < bytes <= capacity), capped at the capacity:
// powers of two from 64 KiB to 1 MiB, then four classes per doubling (1, 1.25, 1.5, 1.75 x 2^k),
// so a block above 1 MiB is never more than a fifth unused. Steps of the same shapes ask the same
// classes, so their blocks are reused and nothing is allocated after the first step.
inline size_t pinned_size_class(size_t bytes, size_t capacity) {
  constexpr size_t kMiB = size_t{1} << 20;
  size_t c = size_t{64} << 10;
  while (c < bytes && c < kMiB) c <<= 1;
  if (c < bytes) {
    size_t pow = kMiB;
    while (pow <= bytes / 2) pow <<= 1;  // the largest power of two <= bytes
    const size_t step = pow / 4;
    c = (bytes + step - 1) / step * step;
  }
  return c < capacity ? c : capacity;
}

// One pooled block. `events` are recorded by the block's holder while it is lent and read by the
// pool only while it is not. A list: erasing from a vector move-assigns the survivors, and c10's
// CUDAEvent move-assign overwrites its event without destroying it (every completed event leaked).
// `lent`: a handle holds it. `graph`: the id of the graph hold a capturing acquire gave it (0:
// none), out of the pool until that graph is destroyed (NOTE [ Pinned blocks and graphs ]).
template <class Event>
struct PoolBlock {
  void* ptr = nullptr;
  size_t size = 0;
  bool lent = false;
  uint64_t graph = 0;
  uint64_t released_at = 0;
  std::list<Event> events;
};

// NOTE [ Pinned blocks and graphs ]
// While a CUDA graph is being captured no event may be queried or waited on (an error, or in
// relaxed mode an event that later queries fail on), no pinned memory freed (an implicit sync),
// and a block the capture reads is read again by every replay. So a capturing acquire never
// queries, waits or frees: it takes an idle block with no events left or allocates one, and the
// graph holds it (no events are recorded on it) until its GraphReturn runs: CUDA calls it, through
// a user object of the graph, once the graph and every executable made from it are destroyed and
// their launches done, so the block comes back idle. Held blocks count against the capacity; once
// it is spent a capturing acquire gets nothing and the caller raises or takes a capturable path.
// release(), stats() and a GraphReturn never query events, so they cannot throw a device's error.

// Backend: `using Event`; void* alloc(size_t) (nullptr when out of memory; throws on any other
// error); void free(void*); bool done(Event&) (non-blocking); void wait(Event&) (blocks).
template <class Backend>
class BlockPool {
  struct Alive {  // the pool as graph returns reach it: null once it is destroyed
    std::mutex mu;
    BlockPool* pool = nullptr;
  };

 public:
  using Event = typename Backend::Event;
  using Block = PoolBlock<Event>;

  // A graph's hold on one block, handed back by calling it (once; later calls do nothing). Safe
  // from any thread, after the pool was emptied (the block comes back idle) or destroyed (nothing
  // happens; the block's memory stays allocated). Takes the pool's lock, calls no backend.
  class GraphReturn {
   public:
    void operator()() noexcept {
      const std::shared_ptr<Alive> alive = std::move(alive_);
      if (alive == nullptr) return;
      std::lock_guard<std::mutex> lock(alive->mu);
      if (alive->pool != nullptr) alive->pool->graph_returned(block_, hold_);
    }

   private:
    friend class BlockPool;
    GraphReturn(std::shared_ptr<Alive> alive, Block* block, uint64_t hold)
        : alive_(std::move(alive)), block_(block), hold_(hold) {}
    std::shared_ptr<Alive> alive_;
    Block* block_;
    uint64_t hold_;
  };

  explicit BlockPool(size_t capacity) : capacity_(capacity), alive_(std::make_shared<Alive>()) {
    alive_->pool = this;
  }
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;
  ~BlockPool() {
    std::lock_guard<std::mutex> lock(alive_->mu);
    alive_->pool = nullptr;
  }

  // A lent block of at least `bytes`, or nullptr (bytes == 0 or above the capacity, out of
  // memory, or every block lent). Allocates only when no block of the class is idle and the
  // capacity has room; otherwise waits, without the lock, on the oldest in-flight block.
  // `capturing`: a graph capture is under way (NOTE [ Pinned blocks and graphs ]). Rethrows the
  // backend's errors with the pool's state unchanged.
  Block* acquire(size_t bytes, bool capturing = false) {
    std::unique_lock<std::mutex> lock(mu_);
    if (bytes == 0 || bytes > capacity_) return nullptr;
    const size_t cls = pinned_size_class(bytes, capacity_);
    if (capturing) {
      for (Block* b : by_class_[cls]) {
        if (!b->lent && b->graph == 0 && b->events.empty()) return hold_for_graph(b);
      }
      std::vector<void*> none;
      Block* b = reserved_ + cls <= capacity_ ? allocate(lock, cls, none) : nullptr;
      return b != nullptr ? hold_for_graph(b) : nullptr;
    }
    for (;;) {
      for (Block* b : by_class_[cls]) {
        if (!b->lent && idle(*b)) return lend(b);
      }
      std::vector<void*> freed;
      while (reserved_ + cls > capacity_ && take_idle_other_than(cls, freed)) {
      }
      if (reserved_ + cls <= capacity_) return allocate(lock, cls, freed);
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
      try {
        for (Event& e : events) backend_.wait(e);
      } catch (...) {
        lock.lock();
        oldest->lent = false;
        throw;
      }
      events.clear();
      lock.lock();
      if (oldest->size == cls) return oldest;
      oldest->lent = false;  // idle now, of another class: freed by the next round if needed
    }
  }

  // Returns a lent block; its recorded events decide when it is lent again (a block held by a
  // graph stays out until its GraphReturn). Never queries an event, never throws a backend's error.
  void release(Block* b) {
    std::lock_guard<std::mutex> lock(mu_);
    b->lent = false;
    b->released_at = ++clock_;
  }

  // The return of the graph hold on `b` (lent by a capturing acquire; a no-op for any other).
  GraphReturn graph_return(Block* b) {
    std::lock_guard<std::mutex> lock(mu_);
    return GraphReturn(alive_, b, b->graph);
  }

  // Counters; in_flight: blocks not lent whose events are not yet seen complete. Queries nothing.
  std::vector<std::pair<std::string, int64_t>> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t lent = 0, in_flight = 0, graph = 0;
    for (auto& b : blocks_) {
      if (b->graph != 0) {
        graph += static_cast<int64_t>(b->size);
      } else if (b->lent) {
        lent += static_cast<int64_t>(b->size);
      } else if (!b->events.empty()) {
        in_flight += static_cast<int64_t>(b->size);
      }
    }
    return {{"capacity", static_cast<int64_t>(capacity_)},
            {"reserved", static_cast<int64_t>(reserved_)},
            {"lent", lent},
            {"in_flight", in_flight},
            {"graph_held", graph},
            {"graph_returns", graph_returns_},
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

  Backend& backend() { return backend_; }

 private:
  Block* lend(Block* b) {
    b->lent = true;
    return b;
  }

  Block* hold_for_graph(Block* b) {
    b->graph = ++holds_;
    return lend(b);
  }

  // Called by a GraphReturn while the pool lives: `hold` is over, the block is lent again once
  // its handle released it too. The block exists: one held by a graph is never freed.
  void graph_returned(Block* b, uint64_t hold) {
    std::lock_guard<std::mutex> lock(mu_);
    if (hold == 0 || b->graph != hold) return;
    b->graph = 0;
    b->released_at = ++clock_;
    ++graph_returns_;
  }

  // A new lent block of class `cls` (room checked by the caller), allocated without the lock
  // after freeing `freed`; nullptr when out of memory. Rethrows the backend's other errors.
  Block* allocate(std::unique_lock<std::mutex>& lock, size_t cls, std::vector<void*>& freed) {
    reserved_ += cls;
    ++allocations_;
    lock.unlock();
    free_all(freed);
    void* ptr = nullptr;
    try {
      ptr = backend_.alloc(cls);
    } catch (...) {
      lock.lock();
      reserved_ -= cls;
      --allocations_;
      throw;
    }
    lock.lock();
    if (ptr == nullptr) {
      reserved_ -= cls;
      --allocations_;
      return nullptr;  // out of pinned memory: the caller takes the unstaged path
    }
    blocks_.push_back(std::make_unique<Block>());
    Block* b = blocks_.back().get();
    b->ptr = ptr;
    b->size = cls;
    by_class_[cls].push_back(b);
    return lend(b);
  }

  // Whether every event recorded on the block completed; drops those that did.
  bool idle(Block& b) {
    if (b.lent || b.graph != 0) return false;
    b.events.remove_if([this](Event& e) { return backend_.done(e); });
    return b.events.empty();
  }

  Block* oldest_in_flight(size_t cls) {
    Block* same = nullptr;
    Block* any = nullptr;
    for (auto& b : blocks_) {
      if (b->lent || b->graph != 0 || b->events.empty()) continue;
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

  void free_all(std::vector<void*>& freed) {
    for (void* p : freed) backend_.free(p);
    freed.clear();
  }

  Backend backend_;
  std::mutex mu_;
  size_t capacity_;
  size_t reserved_ = 0;
  int64_t allocations_ = 0, frees_ = 0, waits_ = 0, graph_returns_ = 0;
  uint64_t clock_ = 0, holds_ = 0;
  std::vector<std::unique_ptr<Block>> blocks_;
  std::map<size_t, std::list<Block*>> by_class_;  // every block by size class, lent or not
  std::shared_ptr<Alive> alive_;
};

}  // namespace fastdp
