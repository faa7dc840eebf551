#include "cuda/peer_access.h"

#include "cuda/cuda_event.h"  // before any header that includes CUDAEvent.h

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
#include <utility>
#include <vector>

#include "cuda/pinned_pool.h"

namespace fastdp {
namespace {

bool p2p_disabled_by_env() {
  const char* env = std::getenv("FASTDP_P2P");
  return env != nullptr && std::strcmp(env, "0") == 0;
}

// Lets `device` access `peer`'s memory; an access already enabled (by torch, say) is fine.
bool enable_access(c10::DeviceIndex device, c10::DeviceIndex peer) {
  c10::cuda::CUDAGuard guard(device);
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaSuccess || err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
    return true;
  }
  (void)cudaGetLastError();
  return false;
}

// Sends 1 MiB of a known pattern from `from` to `to` with cudaMemcpyPeerAsync and reads it back.
bool checksum_copy(c10::DeviceIndex from, c10::DeviceIndex to) {
  constexpr size_t kBytes = size_t{1} << 20;
  std::vector<uint32_t> sent(kBytes / 4), got(kBytes / 4, 0);
  for (size_t k = 0; k < sent.size(); ++k) {
    sent[k] = static_cast<uint32_t>(k * 2654435761u + 12345u);
  }
  void* a = nullptr;
  void* b = nullptr;
  bool ok = false;
  {
    c10::cuda::CUDAGuard guard(from);
    C10_CUDA_CHECK(cudaMalloc(&a, kBytes));
  }
  {
    c10::cuda::CUDAGuard guard(to);
    const cudaError_t err = cudaMalloc(&b, kBytes);
    if (err != cudaSuccess) {
      c10::cuda::CUDAGuard g2(from);
      C10_CUDA_CHECK_WARN(cudaFree(a));
      C10_CUDA_CHECK(err);
    }
  }
  {
    const c10::cuda::CUDAStream s_from = c10::cuda::getStreamFromPool(false, from);
    const c10::cuda::CUDAStream s_to = c10::cuda::getStreamFromPool(false, to);
    c10::cuda::CUDAGuard guard(from);
    cudaError_t err = cudaMemcpyAsync(a, sent.data(), kBytes, cudaMemcpyHostToDevice, s_from);
    if (err == cudaSuccess) err = cudaStreamSynchronize(s_from);
    if (err == cudaSuccess) {
      c10::cuda::CUDAGuard g2(to);
      err = cudaMemcpyPeerAsync(b, to, a, from, kBytes, s_to);
      if (err == cudaSuccess) {
        err = cudaMemcpyAsync(got.data(), b, kBytes, cudaMemcpyDeviceToHost, s_to);
      }
      if (err == cudaSuccess) err = cudaStreamSynchronize(s_to);
    }
    (void)cudaGetLastError();
    ok = err == cudaSuccess && got == sent;
  }
  {
    c10::cuda::CUDAGuard guard(from);
    C10_CUDA_CHECK_WARN(cudaFree(a));
  }
  {
    c10::cuda::CUDAGuard guard(to);
    C10_CUDA_CHECK_WARN(cudaFree(b));
  }
  return ok;
}

bool decide(c10::DeviceIndex a, c10::DeviceIndex b) {
  if (p2p_disabled_by_env()) return false;
  int ab = 0, ba = 0;
  C10_CUDA_CHECK(cudaDeviceCanAccessPeer(&ab, a, b));
  C10_CUDA_CHECK(cudaDeviceCanAccessPeer(&ba, b, a));
  if (!ab || !ba || !enable_access(a, b) || !enable_access(b, a)) return false;
  if (checksum_copy(a, b) && checksum_copy(b, a)) return true;
  TORCH_WARN("fastdp: peer access between cuda:", static_cast<int>(a), " and cuda:",
             static_cast<int>(b), " is reported but a verification copy returned wrong bytes; ",
             "copies between them are staged through host memory (set FASTDP_P2P=0 to skip the ",
             "check)");
  return false;
}

// Copies through pinned host blocks, window by window; without a block, through pageable memory
// (the D2H then needs a stream synchronisation, still never a device-wide one).
void staged_copy(char* dst, const c10::cuda::CUDAStream& dst_stream, const char* src,
                 const c10::cuda::CUDAStream& src_stream, size_t bytes) {
  const size_t window = std::max<size_t>(staging_window(bytes), 1);
  for (size_t off = 0; off < bytes; off += window) {
    const size_t n = std::min(window, bytes - off);
    PinnedBlock block = pinned_acquire(n);
    std::vector<char> pageable;
    void* host = block ? block.data() : (pageable.resize(n), pageable.data());
    {
      c10::cuda::CUDAGuard guard(src_stream.device_index());
      C10_CUDA_CHECK(cudaMemcpyAsync(host, src + off, n, cudaMemcpyDeviceToHost, src_stream));
    }
    if (block) {
      block.record(src_stream);
      c10::cuda::CUDAEvent copied;
      copied.record(src_stream);
      copied.block(dst_stream);
    } else {
      C10_CUDA_CHECK(cudaStreamSynchronize(src_stream));
    }
    c10::cuda::CUDAGuard guard(dst_stream.device_index());
    C10_CUDA_CHECK(cudaMemcpyAsync(dst + off, host, n, cudaMemcpyHostToDevice, dst_stream));
    if (block) block.record(dst_stream);
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
  c10::cuda::CUDAEvent ready;
  ready.record(src_stream);
  ready.block(dst_stream);
  c10::cuda::CUDAGuard guard(d);
  C10_CUDA_CHECK(cudaMemcpyPeerAsync(dst, d, src, s, bytes, dst_stream));
}

}  // namespace fastdp
