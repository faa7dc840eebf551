#include "cuda/peer_access.h"

#include "cuda/torch_cuda_headers.h"  // before any header that includes them

#include <ATen/ATen.h>
#include <ATen/cuda/PeerToPeerAccess.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/pinned_pool.h"
#include "transfer.h"

// NOTE [ Peer access ]
// p2p_usable decides once per pair: FASTDP_P2P=0 says no; else torch's get_p2p_access both ways
// (it also maps the caching allocator's expandable segments and cudaMallocAsync pools into the
// peer, which cudaDeviceEnablePeerAccess alone does not), then a checksum copy each way
// through direct_copy. Any failure warns once and stages the pair: never an error per scatter.
// A direct copy runs on dst_stream, not ATen's copy_ (which queues every copy of a scatter on the
// source's stream, one behind another), so a scatter's copies overlap. Ordering is copy_'s
// two-way barrier: dst_stream waits for src_stream, then src_stream for dst_stream, so the
// caller's next work on the source (a write, a free) cannot overtake the read.

namespace fastdp {
namespace {

bool p2p_disabled_by_env() {
  const char* env = std::getenv("FASTDP_P2P");
  return env != nullptr && std::strcmp(env, "0") == 0;
}

void direct_copy(void* dst, c10::DeviceIndex d, const void* src, c10::DeviceIndex s, size_t bytes,
                 const c10::cuda::CUDAStream& dst_stream) {
  c10::cuda::CUDAGuard guard(d);
  C10_CUDA_CHECK(cudaMemcpyPeerAsync(dst, d, src, s, bytes, dst_stream));
}

// Copies 1 MiB of a known pattern from `from` to `to` (tensors of the caching allocator) with
// direct_copy and reads it back. Throws on CUDA errors and OOM; decide() catches.
bool checksum_copy(c10::DeviceIndex from, c10::DeviceIndex to) {
  constexpr int64_t kWords = (int64_t{1} << 20) / 4;
  at::Tensor sent = at::empty({kWords}, at::kInt);
  int32_t* p = sent.data_ptr<int32_t>();
  for (int64_t k = 0; k < kWords; ++k) {
    p[k] = static_cast<int32_t>(static_cast<uint32_t>(k) * 2654435761u + 12345u);
  }
  at::Tensor a = sent.to(at::Device(at::kCUDA, from));  // synchronous: ready when it returns
  at::Tensor b = at::empty({kWords}, sent.options().device(at::kCUDA, to));
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(to);
  direct_copy(b.data_ptr(), to, a.data_ptr(), from, static_cast<size_t>(kWords * 4), stream);
  return at::equal(b.cpu(), sent);  // b.cpu() runs on `stream` and synchronises it
}

bool decide(c10::DeviceIndex a, c10::DeviceIndex b) {
  if (p2p_disabled_by_env()) return false;
  std::string why;
  try {
    if (!at::cuda::get_p2p_access(a, b) || !at::cuda::get_p2p_access(b, a)) return false;
    if (checksum_copy(a, b) && checksum_copy(b, a)) return true;
    why = "a verification copy returned wrong bytes";
  } catch (const c10::Error& e) {
    (void)cudaGetLastError();
    why = std::string("enabling or verifying it failed: ") + e.what_without_backtrace();
  }
  TORCH_WARN("fastdp: peer access between cuda:", static_cast<int>(a),
             " and cuda:", static_cast<int>(b), " is reported but ", why,
             "; copies between them are staged ",
             "through host memory (set FASTDP_P2P=0 to skip the check)");
  return false;
}

// No usable P2P (NOTE [ Peer access ]): per window, D2H into a pinned block on src_stream, an
// event, H2D on dst_stream; without a block, pageable memory and a src_stream sync per window.
// The source is read on src_stream itself, so it needs no barrier with the caller's work there.
void staged_copy(char* dst, const c10::cuda::CUDAStream& dst_stream, const char* src,
                 const c10::cuda::CUDAStream& src_stream, size_t bytes) {
  TORCH_CHECK(!stream_capturing(src_stream) && !stream_capturing(dst_stream),
              "fastdp: a copy between GPUs without peer access goes through host memory and ",
              "cannot be captured into a CUDA graph; set FASTDP_DISABLE_EXT=1 for torch's copies");
  const size_t window = staged_copy_window(bytes, pinned_pool_capacity());
  std::vector<char> pageable;
  for (size_t off = 0; off < bytes; off += window) {
    const size_t n = std::min(window, bytes - off);
    PinnedBlock block = pinned_acquire(n, src_stream);
    if (!block && pageable.size() < n) pageable.resize(n);
    void* host = block ? block.data() : pageable.data();
    {
      c10::cuda::CUDAGuard guard(src_stream.device_index());
      C10_CUDA_CHECK(cudaMemcpyAsync(host, src + off, n, cudaMemcpyDeviceToHost, src_stream));
    }
    if (block) {
      block.record(src_stream);
      at::cuda::CUDAEvent copied;
      copied.record(src_stream);
      copied.block(dst_stream);
    } else {
      C10_CUDA_CHECK(cudaStreamSynchronize(src_stream));
    }
    c10::cuda::CUDAGuard guard(dst_stream.device_index());
    C10_CUDA_CHECK(cudaMemcpyAsync(dst + off, host, n, cudaMemcpyHostToDevice, dst_stream));
    if (block) block.record(dst_stream);  // a pageable H2D returns once it has read `pageable`
  }
}

}  // namespace

bool p2p_usable(c10::DeviceIndex a, c10::DeviceIndex b) {
  if (a == b) return true;
  static std::mutex mu;
  static std::map<std::pair<int, int>, bool> decided;
  const std::pair<int, int> key{std::min(a, b), std::max(a, b)};
  std::lock_guard<std::mutex> lock(mu);
  auto it = decided.find(key);
  if (it == decided.end()) it = decided.emplace(key, decide(key.first, key.second)).first;
  return it->second;
}

void peer_copy(void* dst, const c10::cuda::CUDAStream& dst_stream, const void* src,
               const c10::cuda::CUDAStream& src_stream, size_t bytes) {
  if (bytes == 0) return;
  const c10::DeviceIndex d = dst_stream.device_index();
  const c10::DeviceIndex s = src_stream.device_index();
  if (!p2p_usable(s, d)) {
    staged_copy(static_cast<char*>(dst), dst_stream, static_cast<const char*>(src), src_stream,
                bytes);
    return;
  }
  at::cuda::CUDAEvent ready;  // see NOTE [ Peer access ] (ordering)
  ready.record(src_stream);
  ready.block(dst_stream);
  direct_copy(dst, d, src, s, bytes, dst_stream);
  at::cuda::CUDAEvent read;
  read.record(dst_stream);
  read.block(src_stream);
}

}  // namespace fastdp
