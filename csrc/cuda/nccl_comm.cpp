#include "cuda/nccl_comm.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>
#include <set>
#include <string>

#ifdef FASTDP_WITH_NCCL
#include <nccl.h>
#endif

// NOTE [ NCCL communicators ]
// Why NCCL directly and not torch's wrappers: torch::cuda::nccl::{broadcast,reduce} are exported
// from libtorch_cuda and would link, but they live in torch's internal headers (no stability
// promise), take one tensor per rank per call (one group per bucket, no grouping across buckets)
// and keep their communicator cache in `detail`, unguarded by any lock. setup.py links the NCCL
// that the torch wheel ships (nvidia/nccl, the same libnccl.so.2 soname libtorch_cuda loads, so
// one copy of NCCL is in the process); we own the cache, the grouping and the error messages.
// The win of grouping all buckets into one launch is measured by `python -m fastdp.bench --suite
// multigpu-replicate` (the parameter broadcast alone, torch.nn.parallel.comm.broadcast_coalesced,
// which uses torch.cuda.nccl, vs fastdp); the figure is pending the first multi-GPU run.
// - Creation: ncclCommInitAll(devices) builds a single-process clique, rank r on devices[r]. It is
//   collective and slow (tens to hundreds of ms), hence one cache entry per device tuple, keyed in
//   rank order (the root of a collective is a rank). A single-rank clique is valid. The current
//   device is restored afterwards (NCCL switches devices while initialising).
// - Locking: one process-wide mutex covers cache lookup, creation and every launch from
//   ncclGroupStart to ncclGroupEnd. NCCL's thread-safety rules: a communicator must not be driven
//   by two threads at once, a group must be issued by one thread, and operations on independent
//   communicators of one device must not be issued in parallel either ("Using multiple NCCL
//   communicators concurrently"); two threads launching on overlapping device sets could also
//   enqueue their collectives in different orders on different GPUs and deadlock. Launches are
//   asynchronous, so the lock is held for microseconds. It does not cover NCCL use outside fastdp
//   (torch.cuda.nccl, ProcessGroupNCCL) from other threads at the same moment; nor is the one-
//   thread-many-GPUs launch safe under CUDA graph capture (NCCL advises against it).
// - Grouping: one thread drives every rank, so the calls of all ranks must sit in one group, or the
//   first call would wait for ranks never launched. All buckets of a call share one group (one
//   launch). Nothing is allocated inside the group: an allocation could make the caching allocator
//   free-and-retry (cudaFree synchronises the device) with half a group enqueued. The RAII Group
//   calls ncclGroupEnd on unwinding too, keeping NCCL's per-thread group depth balanced.
// - Streams: each rank runs on its device's current stream, where its buffers were allocated and
//   produced, so no record_stream or event is needed (torch's default as well).
// - Types: broadcast moves bytes (ncclInt8, count = nbytes): bit-exact for every dtype. Reduce maps
//   complex to pairs of reals and bool to max over uint8 (torch's bool sum is logical or).
//   Communicators are blocking (default config): ncclGroupEnd returns after enqueueing, errors are
//   reported by the call, with ncclGetErrorString and ncclGetLastError.
// - Teardown: never. ncclCommDestroy during process exit is undefined (the CUDA driver may already
//   be gone; static destructor order across libraries is unspecified), so torch's comm_destroy is a
//   no-op too. The cache and its mutex are heap objects that are never freed: no destructor runs
//   at exit and the OS reclaims the communicators. There is one entry per device tuple used.

namespace fastdp {

bool nccl_compiled() {
#ifdef FASTDP_WITH_NCCL
  return true;
#else
  return false;
#endif
}

bool nccl_usable(const std::vector<int>& devices) {
  if (!nccl_compiled() || devices.size() < 2) return false;
  return std::set<int>(devices.begin(), devices.end()).size() == devices.size();
}

#ifdef FASTDP_WITH_NCCL

namespace {

std::string last_error(ncclComm_t comm) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  const char* s = ncclGetLastError(comm);
  if (s != nullptr && *s != '\0') return std::string(" (") + s + ")";
#else
  (void)comm;
#endif
  return "";
}

#define FASTDP_NCCL_CHECK(op, call, comm)                                                  \
  do {                                                                                     \
    const ncclResult_t fastdp_r_ = (call);                                                 \
    TORCH_CHECK(fastdp_r_ == ncclSuccess, op, ": ", #call, " failed: NCCL error ",         \
                static_cast<int>(fastdp_r_), " '", ncclGetErrorString(fastdp_r_), "'",     \
                last_error(comm));                                                         \
  } while (0)

std::mutex& nccl_mutex() {
  static auto* mu = new std::mutex();  // never destroyed: See NOTE [ NCCL communicators ]
  return *mu;
}

// Caller holds nccl_mutex(). The reference stays valid: entries are never erased.
const std::vector<ncclComm_t>& communicators(const std::vector<int>& devices, const char* op) {
  static auto* cache = new std::map<std::vector<int>, std::vector<ncclComm_t>>();
  auto it = cache->find(devices);
  if (it != cache->end()) return it->second;
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  {
    c10::cuda::CUDAGuard keep(c10::cuda::current_device());
    FASTDP_NCCL_CHECK(op, ncclCommInitAll(comms.data(), static_cast<int>(devices.size()),
                                          devices.data()),
                      nullptr);
  }
  return cache->emplace(devices, std::move(comms)).first->second;
}

class Group {
 public:
  explicit Group(const char* op) : op_(op) { FASTDP_NCCL_CHECK(op_, ncclGroupStart(), nullptr); }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;
  void end(ncclComm_t comm) {
    ended_ = true;
    FASTDP_NCCL_CHECK(op_, ncclGroupEnd(), comm);
  }
  ~Group() {
    if (!ended_) (void)ncclGroupEnd();  // unwinding: balance the group, the error is in flight
  }

 private:
  const char* op_;
  bool ended_ = false;
};

bool sum_type(at::ScalarType t, ncclDataType_t* type, size_t* per_elem, ncclRedOp_t* red) {
  *per_elem = 1;
  *red = ncclSum;
  switch (t) {
    case at::kFloat: *type = ncclFloat32; return true;
    case at::kDouble: *type = ncclFloat64; return true;
    case at::kHalf: *type = ncclFloat16; return true;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0)
    case at::kBFloat16: *type = ncclBfloat16; return true;
#endif
    case at::kLong: *type = ncclInt64; return true;
    case at::kInt: *type = ncclInt32; return true;
    case at::kChar: *type = ncclInt8; return true;
    case at::kByte: *type = ncclUint8; return true;
    case at::kBool: *type = ncclUint8; *red = ncclMax; return true;
    case at::kComplexFloat: *type = ncclFloat32; *per_elem = 2; return true;
    case at::kComplexDouble: *type = ncclFloat64; *per_elem = 2; return true;
    case at::kComplexHalf: *type = ncclFloat16; *per_elem = 2; return true;
    default: return false;
  }
}

std::vector<cudaStream_t> current_streams(const std::vector<int>& devices) {
  std::vector<cudaStream_t> streams;
  for (int d : devices) {
    streams.push_back(at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(d)).stream());
  }
  return streams;
}

}  // namespace

bool nccl_can_sum(at::ScalarType dtype) {
  ncclDataType_t type;
  size_t per_elem;
  ncclRedOp_t red;
  return sum_type(dtype, &type, &per_elem, &red);
}

void nccl_broadcast(const std::vector<int>& devices,
                    const std::vector<std::vector<at::Tensor>>& bufs, int root, const char* op) {
  const auto streams = current_streams(devices);
  std::lock_guard<std::mutex> lock(nccl_mutex());
  const auto& comms = communicators(devices, op);
  c10::cuda::OptionalCUDAGuard guard;
  Group group(op);
  for (const auto& bucket : bufs) {
    const size_t nbytes = bucket[root].nbytes();
    if (nbytes == 0) continue;  // skipped on every rank alike
    for (size_t r = 0; r < devices.size(); ++r) {
      guard.set_index(static_cast<c10::DeviceIndex>(devices[r]));
      // The root's buffer is only read (in place: sendbuff == recvbuff).
      void* p = static_cast<int>(r) == root ? const_cast<void*>(bucket[r].const_data_ptr())
                                            : bucket[r].mutable_data_ptr();
      FASTDP_NCCL_CHECK(op, ncclBroadcast(p, p, nbytes, ncclInt8, root, comms[r], streams[r]),
                        comms[r]);
    }
  }
  group.end(comms[root]);
}

void nccl_reduce(const std::vector<int>& devices,
                 const std::vector<std::vector<at::Tensor>>& sends,
                 const std::vector<at::Tensor>& outs, int root, const char* op) {
  const auto streams = current_streams(devices);
  std::lock_guard<std::mutex> lock(nccl_mutex());
  const auto& comms = communicators(devices, op);
  c10::cuda::OptionalCUDAGuard guard;
  Group group(op);
  for (size_t b = 0; b < sends.size(); ++b) {
    ncclDataType_t type;
    size_t per_elem;
    ncclRedOp_t red;
    TORCH_CHECK(sum_type(outs[b].scalar_type(), &type, &per_elem, &red), op,
                ": NCCL cannot sum dtype ", outs[b].scalar_type());
    const size_t count = static_cast<size_t>(outs[b].numel()) * per_elem;
    if (count == 0) continue;
    for (size_t r = 0; r < devices.size(); ++r) {
      guard.set_index(static_cast<c10::DeviceIndex>(devices[r]));
      void* recv = static_cast<int>(r) == root ? outs[b].mutable_data_ptr() : nullptr;
      FASTDP_NCCL_CHECK(op, ncclReduce(sends[b][r].const_data_ptr(), recv, count, type, red, root,
                                       comms[r], streams[r]),
                        comms[r]);
    }
  }
  group.end(comms[root]);
}

std::vector<std::tuple<int64_t, int64_t, int64_t>> nccl_communicator_info(
    const std::vector<int64_t>& devices) {
  constexpr const char* op = "fastdp.nccl_comm_info";
  TORCH_CHECK(!devices.empty(), op, ": expected at least one device");
  const std::vector<int> devs(devices.begin(), devices.end());
  TORCH_CHECK(std::set<int>(devs.begin(), devs.end()).size() == devs.size(), op,
              ": devices must be distinct, got ", c10::IntArrayRef(devices));
  std::lock_guard<std::mutex> lock(nccl_mutex());
  const auto& comms = communicators(devs, op);
  std::vector<std::tuple<int64_t, int64_t, int64_t>> info;
  for (auto* comm : comms) {
    int device = -1, rank = -1, count = -1;
    FASTDP_NCCL_CHECK(op, ncclCommCuDevice(comm, &device), comm);
    FASTDP_NCCL_CHECK(op, ncclCommUserRank(comm, &rank), comm);
    FASTDP_NCCL_CHECK(op, ncclCommCount(comm, &count), comm);
    info.emplace_back(device, rank, count);
  }
  return info;
}

#else  // !FASTDP_WITH_NCCL

bool nccl_can_sum(at::ScalarType /*dtype*/) { return false; }

void nccl_broadcast(const std::vector<int>&, const std::vector<std::vector<at::Tensor>>&, int,
                    const char* op) {
  TORCH_CHECK(false, op, ": this fastdp build has no NCCL");
}

void nccl_reduce(const std::vector<int>&, const std::vector<std::vector<at::Tensor>>&,
                 const std::vector<at::Tensor>&, int, const char* op) {
  TORCH_CHECK(false, op, ": this fastdp build has no NCCL");
}

std::vector<std::tuple<int64_t, int64_t, int64_t>> nccl_communicator_info(
    const std::vector<int64_t>&) {
  TORCH_CHECK(false, "fastdp.nccl_comm_info: this fastdp build has no NCCL");
}

#endif  // FASTDP_WITH_NCCL

}  // namespace fastdp
