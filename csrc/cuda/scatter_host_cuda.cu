#include "cuda/scatter_host_cuda.h"

#include "cuda/torch_cuda_headers.h"  // before any header that includes them

#include <ATen/Parallel.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "copy_layout.h"
#include "cuda/pinned_pool.h"
#include "host_copy_route.h"

namespace fastdp {
namespace {

// NOTE [ Stream order of host copies ]
// Pinned chunks are copied on the destination's current stream, as torch's .to() copies them, and
// never read by the host: one DMA per dense chunk, a 2-D DMA for one strided level, else the
// source's span and a device copy, or rows one by one (route_host_copy). A batch still being filled
// by a non_blocking copy on that stream is read after it lands, and a capture replays the current
// bytes; torch's host allocator records the stream on the source's block. Host writes into the
// source after the call race with the DMA, as they do with torch's non_blocking copies. Pageable
// chunks cannot be the target of a copy in flight: they are packed on the host now and sent on the
// device's copy stream, which the current stream waits on (an event); under capture they are
// refused (a host copy is not replayed).

at::Tensor byte_buffer(int64_t total, c10::DeviceIndex device) {
  return at::empty({total}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
}

int64_t max_pitch(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::map<int, int64_t> known;
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(device);
  if (it != known.end()) return it->second;
  int pitch = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, device));
  return known[device] = pitch;
}

// The rows of a k2D or kRows route from source byte `so` to destination byte `d0`: one 2-D copy of
// `height` rows, or (height 1) a plain copy of `width` bytes.
void h2d(char* dst, const char* src, const HostCopyRoute& p, int64_t so, int64_t d0,
         const c10::cuda::CUDAStream& stream) {
  if (p.height == 1) {
    C10_CUDA_CHECK(cudaMemcpyAsync(dst + d0, src + so, p.width, cudaMemcpyHostToDevice, stream));
    return;
  }
  TORCH_INTERNAL_ASSERT(p.spitch >= p.width && p.dpitch >= p.width, "fastdp: a 2-D host copy ",
                        "with pitches ", p.spitch, " and ", p.dpitch, " below its width ", p.width);
  C10_CUDA_CHECK(cudaMemcpy2DAsync(dst + d0, p.dpitch, src + so, p.spitch, p.width, p.height,
                                   cudaMemcpyHostToDevice, stream));
}

// One pinned chunk into `out` (its region at `dst`) on `stream`, the current stream.
void copy_pinned(const ChunkCopy& c, at::Tensor& out, char* dst,
                 const c10::cuda::CUDAStream& stream, int64_t pitch_limit) {
  const at::Tensor& src = c.chunk;
  const int64_t item = src.element_size();
  const char* from = static_cast<const char*>(src.storage().data()) + src.storage_offset() * item;
  const HostCopyRoute p =
      route_host_copy(src.sizes().vec(), src.strides().vec(), c.strides, item, pitch_limit);
  if (p.kind == HostCopyRoute::kSpan) {
    const at::Tensor scratch = byte_buffer(p.span, stream.device_index());  // for this stream
    C10_CUDA_CHECK(
        cudaMemcpyAsync(scratch.data_ptr(), from, p.span, cudaMemcpyHostToDevice, stream));
    out.copy_(view_into(scratch, 0, src.scalar_type(), src.sizes(), src.strides()));
  } else if (p.kind == HostCopyRoute::kRows) {
    const size_t n = p.outer_sizes.size();
    std::vector<int64_t> idx(n, 0);
    for (;;) {
      int64_t so = 0, d0 = 0;
      for (size_t k = 0; k < n; ++k) {
        so += idx[k] * p.outer_sstrides[k];
        d0 += idx[k] * p.outer_dstrides[k];
      }
      h2d(dst, from, p, so, d0, stream);
      size_t k = n;
      while (k > 0 && ++idx[k - 1] == p.outer_sizes[k - 1]) idx[--k] = 0;
      if (k == 0) break;
    }
  } else if (p.kind == HostCopyRoute::k2D) {
    h2d(dst, from, p, 0, 0, stream);
  } else {  // kDense
    C10_CUDA_CHECK(cudaMemcpyAsync(dst, from, p.width, cudaMemcpyHostToDevice, stream));
  }
  if (src.is_conj()) out.conj_physical_();  // the bytes copied are the unresolved ones
  if (src.is_neg()) out.neg_();
}

// A contiguous run of a pageable chunk: `src` (rows of it) goes to byte `off` of the buffer.
struct Piece {
  const ChunkCopy* c;
  at::Tensor src;
  int64_t off;
};

// Packs `pieces` into one pinned block and sends them with one H2D on `stream`, or copies them one
// by one through torch when no block is available. `buf` is the destination buffer.
void flush_window(std::vector<Piece>& pieces, int64_t begin, int64_t end, const at::Tensor& buf,
                  const c10::cuda::CUDAStream& stream) {
  if (pieces.empty()) return;
  PinnedBlock block = pinned_acquire(static_cast<size_t>(end - begin), stream);
  auto dst_part = [&](const Piece& p) {
    if (!block) return view_into(buf, p.off, p.src.scalar_type(), p.src.sizes(), p.c->strides);
    return at::from_blob(static_cast<char*>(block.data()) + (p.off - begin), p.src.sizes(),
                         p.c->strides, p.src.options().pinned_memory(false));
  };
  const int64_t n = static_cast<int64_t>(pieces.size());
  auto pack = [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) dst_part(pieces[k]).copy_(pieces[k].src, true);
  };
  c10::cuda::CUDAStreamGuard guard(stream);
  if (block && n >= at::get_num_threads()) {
    at::parallel_for(0, n, 1, pack);  // host packing, one piece per task
  } else {
    pack(0, n);  // each copy_ parallel itself; or torch's own H2D copies when unstaged
  }
  if (block) {
    C10_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(buf.data_ptr()) + begin, block.data(),
                                   end - begin, cudaMemcpyHostToDevice, stream));
    block.record(stream);
  }
  pieces.clear();
}

}  // namespace

int64_t lay_out(const std::vector<ChunkCopy*>& copies, int64_t start) {
  int64_t off = start;
  for (ChunkCopy* c : copies) {
    off = align_up(off, kRegionAlign);
    c->offset = off;
    off += c->nbytes;
  }
  return off;
}

void scatter_pinned(const std::vector<ChunkCopy*>& copies, c10::DeviceIndex device,
                    std::vector<std::vector<at::Tensor>>& result) {
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device);
  const int64_t total = lay_out(copies, 0);
  const at::Tensor buf = byte_buffer(total, device);
  const int64_t pitch_limit = max_pitch(device);
  c10::cuda::CUDAStreamGuard guard(current);
  for (ChunkCopy* c : copies) {
    at::Tensor& out = result[c->r][c->i];
    out = view_into(buf, c->offset, c->chunk.scalar_type(), c->chunk.sizes(), c->strides);
    if (c->nbytes == 0) continue;
    copy_pinned(*c, out, static_cast<char*>(buf.data_ptr()) + c->offset, current, pitch_limit);
    const c10::Storage& st = c->chunk.storage();
    at::getHostAllocator(at::kCUDA)->record_event(const_cast<void*>(st.data()),
                                                  st.data_ptr().get_context(), current.unwrap());
  }
}

// See NOTE [ Pinned staging ]: windows of whole rows (stage_rows), one H2D each.
void scatter_pageable(const std::vector<ChunkCopy*>& copies, c10::DeviceIndex device,
                      std::vector<std::vector<at::Tensor>>& result) {
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device);
  TORCH_CHECK(!stream_capturing(current), "fastdp.scatter_chunks: a pageable CPU tensor cannot ",
              "be copied to cuda:", static_cast<int>(device), " while a CUDA graph is being ",
              "captured (its host copy would not be replayed): pin it (tensor.pin_memory()) or ",
              "move it to the GPU before the capture");
  const c10::cuda::CUDAStream stream = copy_stream(device);
  const int64_t total = lay_out(copies, 0);
  at::Tensor buf;
  {
    c10::cuda::CUDAStreamGuard guard(stream);  // allocated for the copy stream, used on current
    buf = byte_buffer(total, device);
  }
  if (total > 0) buf.record_stream(current);
  for (ChunkCopy* c : copies) {
    result[c->r][c->i] =
        view_into(buf, c->offset, c->chunk.scalar_type(), c->chunk.sizes(), c->strides);
  }
  const int64_t window = static_cast<int64_t>(staging_window(static_cast<size_t>(total)));
  std::vector<Piece> pieces;
  int64_t begin = 0, end = 0;
  for (ChunkCopy* c : copies) {
    if (c->nbytes == 0) continue;
    if (window == 0) {  // staging off: torch's own copy
      c10::cuda::CUDAStreamGuard guard(stream);
      result[c->r][c->i].copy_(c->chunk, /*non_blocking=*/true);
      continue;
    }
    const int64_t item = c->chunk.element_size();
    const StageRows rows = stage_rows(c->chunk.sizes().vec(), c->strides, item, window);
    std::vector<int64_t> idx(rows.outer.size(), 0);
    for (;;) {  // every index of the outer dims, then ranges of rows within the window
      at::Tensor part = c->chunk;
      int64_t base = c->offset;
      for (size_t k = 0; k < idx.size(); ++k) {
        part = part.narrow(rows.outer[k], idx[k], 1);
        base += idx[k] * c->strides[rows.outer[k]] * item;
      }
      for (int64_t row0 = 0; row0 < rows.count;) {
        const int64_t start = base + row0 * rows.bytes;
        if (!pieces.empty() && start + rows.bytes - begin > window) {
          flush_window(pieces, begin, end, buf, stream);
        }
        if (pieces.empty()) begin = start;
        const int64_t n = std::max<int64_t>(
            1, std::min(rows.count - row0, (window - (start - begin)) / rows.bytes));
        pieces.push_back({c, rows.dim < 0 ? part : part.narrow(rows.dim, row0, n), start});
        end = start + n * rows.bytes;
        row0 += n;
      }
      size_t k = idx.size();
      while (k > 0 && ++idx[k - 1] == c->chunk.size(rows.outer[k - 1])) idx[--k] = 0;
      if (k == 0) break;
    }
  }
  flush_window(pieces, begin, end, buf, stream);
  at::cuda::CUDAEvent done;
  done.record(stream);
  done.block(current);
}

}  // namespace fastdp
