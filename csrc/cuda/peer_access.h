#pragma once
// Peer-to-peer access between CUDA devices, detected, enabled and verified once per pair, and the
// one device-to-device copy that scatter and gather use (never NCCL, so never a hang).

#include <c10/cuda/CUDAStream.h>

#include <cstddef>

namespace fastdp {

// Whether copies between devices a and b (a != b) go direct: FASTDP_P2P is not "0", torch's
// at::cuda::get_p2p_access holds both ways (it enables the access, caching allocator included) and
// a checksum copy each way between allocator tensors returned the bytes sent. Decided once per
// pair per process, thread-safe; a failed check (any error, OOM included) warns once and says no.
// See NOTE [ Peer access ].
bool p2p_usable(c10::DeviceIndex a, c10::DeviceIndex b);

// Copies `bytes` from `src` (device src_stream.device_index()) to `dst` (device dst_stream's).
// Precondition: src is ready on src_stream; dst may be written by work ordered on dst_stream.
// Afterwards dst is ready on dst_stream and work queued next on src_stream runs after the read
// (events, no device sync). Direct (cudaMemcpyPeerAsync on dst_stream) when p2p_usable, else staged
// through pinned host blocks in windows (D2H on src_stream, H2D on dst_stream). A direct copy reads
// src on dst_stream: a caller whose src was allocated on another stream record_stream()s it.
void peer_copy(void* dst, const c10::cuda::CUDAStream& dst_stream, const void* src,
               const c10::cuda::CUDAStream& src_stream, size_t bytes);

}  // namespace fastdp
