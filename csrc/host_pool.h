#pragma once
// BlockPool over host memory, for tests of the pinned pool's logic in every build: blocks from
// malloc, events are flags that complete() sets (a wait sets its flag, as a stream reaching the
// event would). Faults can be injected: allocations that fail (out of memory, or another error)
// and event queries that throw (a device fault). A graph is a HostGraph: destroying it runs the
// GraphReturns of its blocks, as CUDA runs a graph's user objects. Bound as
// fastdp._C._HostBlockPool and fastdp._C._HostGraph.

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pinned_pool_core.h"
#include "py_hidden.h"

namespace fastdp {

struct HostFlagBackend {
  using Event = std::shared_ptr<std::atomic<bool>>;
  std::string fail_next;       // "oom": the next alloc returns nullptr; "error": it throws
  bool queries_throw = false;  // done() and wait() throw, as a query after a device fault
  int64_t queries = 0;         // done() and wait() calls so far

  void* alloc(size_t bytes) {
    const std::string how = std::exchange(fail_next, std::string());
    if (how == "error") throw std::runtime_error("HostFlagBackend: injected allocation error");
    return how == "oom" ? nullptr : std::malloc(bytes);
  }
  void free(void* p) { std::free(p); }
  bool done(Event& e) {
    query();
    return e->load();
  }
  void wait(Event& e) {
    query();
    e->store(true);
  }

 private:
  void query() {
    ++queries;
    if (queries_throw) throw std::runtime_error("HostFlagBackend: injected event query error");
  }
};

using HostPoolCore = BlockPool<HostFlagBackend>;

// The graph holding the blocks acquired under one simulated capture. Destroyed (or destroy()): its
// blocks go back to their pool, which may be gone by then; a moved-from graph holds none.
class FASTDP_PY_HIDDEN HostGraph {
 public:
  explicit HostGraph(std::vector<HostPoolCore::GraphReturn> returns)
      : returns_(std::move(returns)) {}
  HostGraph(HostGraph&&) = default;
  HostGraph& operator=(HostGraph&&) = delete;
  ~HostGraph() { destroy(); }

  void destroy() {
    for (HostPoolCore::GraphReturn& r : std::exchange(returns_, {})) r();
  }
  int64_t blocks() const { return static_cast<int64_t>(returns_.size()); }

 private:
  std::vector<HostPoolCore::GraphReturn> returns_;
};

class FASTDP_PY_HIDDEN HostBlockPool {
 public:
  explicit HostBlockPool(int64_t capacity) : pool_(static_cast<size_t>(capacity)) {}

  // Block handle (0: none) and its size. `capturing`: as under a CUDA graph capture, whose graph
  // holds the block until the HostGraph that end_capture() returns is destroyed.
  uintptr_t acquire(int64_t bytes, bool capturing) {
    Block* b = pool_.acquire(static_cast<size_t>(bytes), capturing);
    if (b != nullptr && capturing) capture_.push_back(pool_.graph_return(b));
    return reinterpret_cast<uintptr_t>(b);
  }
  // The graph of the capturing acquires since the last call.
  HostGraph end_capture() { return HostGraph(std::exchange(capture_, {})); }
  int64_t size(uintptr_t block) const { return static_cast<int64_t>(get(block)->size); }
  // An event on the lent block, outstanding until complete(); returns its id.
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
  // Fault injection: the next allocation fails ("oom" or "error"); event queries throw.
  void fail_next_alloc(const std::string& how) { pool_.backend().fail_next = how; }
  void set_queries_throw(bool on) { pool_.backend().queries_throw = on; }
  // Event queries and waits so far.
  int64_t queries() { return pool_.backend().queries; }

 private:
  using Block = HostPoolCore::Block;
  static Block* get(uintptr_t block) { return reinterpret_cast<Block*>(block); }

  HostPoolCore pool_;
  std::vector<HostPoolCore::GraphReturn> capture_;
  std::map<int64_t, HostFlagBackend::Event> events_;
  int64_t last_ = 0;
};

}  // namespace fastdp
