#pragma once
// BlockPool over host memory, for tests of the pinned pool's logic in every build: blocks from
// malloc, events are flags that complete() sets (a wait sets its flag, as a stream reaching the
// event would). Bound as fastdp._C._HostBlockPool.

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pinned_pool_core.h"

namespace fastdp {

// Hidden as pybind11's own types are (bound in bindings.cpp).
#ifndef FASTDP_PY_HIDDEN
#if defined(__GNUC__)
#define FASTDP_PY_HIDDEN __attribute__((visibility("hidden")))
#else
#define FASTDP_PY_HIDDEN
#endif
#endif

struct HostFlagBackend {
  using Event = std::shared_ptr<std::atomic<bool>>;
  static void* alloc(size_t bytes) { return std::malloc(bytes); }
  static void free(void* p) { std::free(p); }
  static bool done(Event& e) { return e->load(); }
  static void wait(Event& e) { e->store(true); }
};

class FASTDP_PY_HIDDEN HostBlockPool {
 public:
  explicit HostBlockPool(int64_t capacity) : pool_(static_cast<size_t>(capacity)) {}

  // Block handle (0: none) and its size.
  uintptr_t acquire(int64_t bytes) {
    return reinterpret_cast<uintptr_t>(pool_.acquire(static_cast<size_t>(bytes)));
  }
  int64_t size(uintptr_t block) const { return static_cast<int64_t>(get(block)->size); }
  // An event on the lent block, pending until complete(); returns its id.
  int64_t record(uintptr_t block) {
    auto e = std::make_shared<std::atomic<bool>>(false);
    get(block)->events.push_back(e);
    events_[++last_] = e;
    return last_;
  }
  void complete(int64_t event) { events_.at(event)->store(true); }
  bool completed(int64_t event) const { return events_.at(event)->load(); }
  void release(uintptr_t block) { pool_.release(get(block)); }
  std::vector<std::pair<std::string, int64_t>> stats() { return pool_.stats(); }
  int64_t set_capacity(int64_t bytes) {
    return static_cast<int64_t>(pool_.set_capacity(static_cast<size_t>(bytes)));
  }
  void empty_cache() { pool_.empty_cache(); }

 private:
  using Block = BlockPool<HostFlagBackend>::Block;
  static Block* get(uintptr_t block) { return reinterpret_cast<Block*>(block); }

  BlockPool<HostFlagBackend> pool_;
  std::map<int64_t, HostFlagBackend::Event> events_;
  int64_t last_ = 0;
};

}  // namespace fastdp
