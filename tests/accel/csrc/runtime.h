// The test device's runtime: devices, streams, events and memory, in host memory.
// Included by accel.cpp only (one translation unit keeps the build short). Process-wide state
// is leaked on purpose: torch keeps pointers to it, and tensors may die after static destructors.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/Stream.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fdpaccel {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 16;
constexpr c10::StreamId kPoolSize = 4;         // pool streams of a device: ids 1..kPoolSize
constexpr c10::StreamId kFirstNewStream = 64;  // getNewStream's ids start here
constexpr int kPoison = 0xFF;  // fresh memory: NaN as a float, -1 as an integer

inline std::atomic<int>& devices() {
  static std::atomic<int> n{0};
  return n;
}
inline std::atomic<bool>& asynchronous() {
  static std::atomic<bool> on{false};
  return on;
}

inline void check_index(int index, const char* op) {
  TORCH_CHECK(index >= 0 && index < devices().load(), "fdpaccel ", op, ": invalid device index ",
              index, ", expected 0 <= index < ", devices().load());
}

// The current device of the calling thread (0 in a new thread, as CUDA's).
inline c10::DeviceIndex& current_device() {
  thread_local c10::DeviceIndex index = 0;
  return index;
}
inline c10::DeviceIndex resolve(c10::DeviceIndex index) {
  return index < 0 ? current_device() : index;
}

// The current stream of each device for the calling thread (0: the default stream).
inline std::array<c10::StreamId, kMaxDevices>& current_streams() {
  thread_local std::array<c10::StreamId, kMaxDevices> ids{};
  return ids;
}

// NOTE [ Lazy streams ]
// A stream is a queue of host tasks (copies, and waits on other streams) that run in order, only
// when something needs their result: a synchronize of the stream, its device or an event recorded
// on it, an event query, or a wait that another stream's task reaches. Kernels run on the host at
// once, after draining their device's current stream. In synchronous mode every task runs as it is
// enqueued. A task enqueued after a position of another stream was taken can only wait for that
// position, so the waits form no cycle; one recursive mutex orders all queues and runs all tasks.
struct StreamState {
  std::deque<std::function<void()>> pending;
  int64_t enqueued = 0;  // tasks ever enqueued
  int64_t executed = 0;  // tasks run, a prefix of the enqueued ones
};

inline std::recursive_mutex& mu() {
  static auto* m = new std::recursive_mutex();  // leaked: used until the process ends
  return *m;
}

// Holds mu(). Tasks that ran are destroyed when the thread's outermost hold ends, outside the
// lock: dropping the last reference to a tensor Python knows may take the GIL, which a thread
// waiting for mu() may hold.
struct Locked {
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  static std::vector<std::function<void()>>& ran() {
    thread_local std::vector<std::function<void()>> r;
    return r;
  }
  Locked() {
    mu().lock();
    ++depth();
  }
  ~Locked() {
    std::vector<std::function<void()>> done;
    if (--depth() == 0) done.swap(ran());
    mu().unlock();
  }
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;
};

// Every stream ever used, by (device, id); never freed, so references stay valid.
inline std::map<std::pair<int, c10::StreamId>, std::unique_ptr<StreamState>>& streams() {
  static auto* all = new std::map<std::pair<int, c10::StreamId>, std::unique_ptr<StreamState>>();
  return *all;
}

inline StreamState& stream_state(c10::DeviceIndex index, c10::StreamId id) {
  Locked g;
  check_index(index, "stream");
  auto& slot = streams()[{index, id}];
  if (!slot) slot = std::make_unique<StreamState>();
  return *slot;
}
inline StreamState& stream_state(const c10::Stream& s) {
  TORCH_CHECK(s.device_type() == kType, "fdpaccel: expected a stream of this device, got ", s);
  return stream_state(s.device_index(), s.id());
}
inline StreamState& current_state(c10::DeviceIndex index) {
  return stream_state(index, current_streams().at(index));
}

// Runs the stream's tasks until `pos` of them have run. See NOTE [ Lazy streams ].
inline void drain_to(StreamState& s, int64_t pos) {
  Locked g;
  while (s.executed < pos) {
    std::function<void()> task = std::move(s.pending.front());
    s.pending.pop_front();
    struct Count {
      StreamState& s;
      std::function<void()>& task;
      ~Count() {
        ++s.executed;
        Locked::ran().push_back(std::move(task));
      }
    } count{s, task};
    task();
  }
}
inline void drain(StreamState& s) {
  Locked g;
  drain_to(s, s.enqueued);
}

// Appends a task; returns the stream's position after it.
inline int64_t enqueue(StreamState& s, std::function<void()> task) {
  Locked g;
  s.pending.push_back(std::move(task));
  const int64_t pos = ++s.enqueued;
  if (!asynchronous().load()) drain_to(s, pos);
  return pos;
}

// `waiter` runs no further task until `target` has run `pos` tasks.
inline void wait_for(StreamState& waiter, StreamState& target, int64_t pos) {
  if (&waiter == &target) return;
  StreamState* t = &target;
  enqueue(waiter, [t, pos] { drain_to(*t, pos); });
}

// Drains every stream of `index` (-1: every device).
inline void synchronize_device(int index) {
  Locked g;
  for (auto& entry : streams())
    if (index < 0 || entry.first.first == index) drain(*entry.second);
}

// An event: the position of a stream's queue it was last recorded at.
struct EventState {
  StreamState* stream = nullptr;
  int64_t pos = 0;
};

// Device memory: host memory tagged with its device, poisoned when fresh, counted per device.
struct Blocks {
  std::mutex m;
  std::unordered_map<void*, std::pair<size_t, c10::DeviceIndex>> live;
  std::array<int64_t, kMaxDevices> bytes{};
  std::set<void*> pinned;
};
inline Blocks& blocks() {
  static auto* b = new Blocks();
  return *b;
}

inline void* host_alloc(size_t n) {
  const size_t rounded = (n + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  TORCH_CHECK(p != nullptr, "fdpaccel: out of host memory allocating ", n, " bytes");
  std::memset(p, kPoison, rounded);
  return p;
}

inline void release_device(void* p) {
  if (p == nullptr) return;
  {
    std::lock_guard<std::mutex> g(blocks().m);
    auto it = blocks().live.find(p);
    if (it != blocks().live.end()) {
      blocks().bytes[it->second.second] -= static_cast<int64_t>(it->second.first);
      blocks().live.erase(it);
    }
  }
  std::free(p);
}

// Allocates on one device (index >= 0) or on the calling thread's current device (-1).
struct DeviceAllocator final : c10::Allocator {
  c10::DeviceIndex index = -1;
  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex d = resolve(index);
    check_index(d, "allocate");
    void* p = n == 0 ? nullptr : host_alloc(n);
    if (p != nullptr) {
      std::lock_guard<std::mutex> g(blocks().m);
      blocks().live[p] = {n, d};
      blocks().bytes[d] += static_cast<int64_t>(n);
    }
    return {p, p, &release_device, c10::Device(kType, d)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release_device; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

inline DeviceAllocator* allocator(c10::DeviceIndex index) {
  static auto* all = [] {
    auto* a = new std::array<DeviceAllocator, kMaxDevices + 1>();
    for (int i = 0; i < kMaxDevices; ++i) (*a)[i].index = static_cast<c10::DeviceIndex>(i);
    return a;
  }();
  return index < 0 ? &(*all)[kMaxDevices] : &(*all)[index];
}

inline void release_pinned(void* p) {
  if (p == nullptr) return;
  {
    std::lock_guard<std::mutex> g(blocks().m);
    blocks().pinned.erase(p);
  }
  std::free(p);
}

// Page-locked host memory, as far as torch can tell: host memory that isPinnedPtr reports.
struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n == 0 ? nullptr : host_alloc(n);
    if (p != nullptr) {
      std::lock_guard<std::mutex> g(blocks().m);
      blocks().pinned.insert(p);
    }
    return {p, p, &release_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

inline PinnedAllocator* pinned_allocator() {
  static auto* a = new PinnedAllocator();
  return a;
}

inline bool is_pinned(const void* p) {
  std::lock_guard<std::mutex> g(blocks().m);
  return blocks().pinned.count(const_cast<void*>(p)) > 0;
}

// Grows or shrinks a device storage in place (contents kept up to the smaller size). Drains every
// stream first: a pending task may hold a pointer into the old memory.
inline void resize_storage_bytes(const c10::Storage& storage, size_t nbytes) {
  synchronize_device(-1);
  c10::DataPtr fresh = allocator(storage.device().index())->allocate(nbytes);
  const size_t keep = std::min(nbytes, storage.nbytes());
  if (keep > 0) std::memcpy(fresh.get(), storage.data(), keep);
  storage.set_data_ptr_noswap(std::move(fresh));
  storage.set_nbytes(nbytes);
}

// A CPU tensor over the same memory as a device tensor; it keeps the storage alive.
inline at::Tensor host_view(const at::Tensor& t) {
  c10::Storage storage = t.storage();
  char* base = static_cast<char*>(storage.mutable_data()) + t.storage_offset() * t.itemsize();
  return at::from_blob(
      base, t.sizes(), t.strides(), [storage](void*) {}, t.options().device(c10::kCPU));
}

}  // namespace fdpaccel
