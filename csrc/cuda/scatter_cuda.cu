#include "cuda/scatter_cuda.h"

#include "cuda/cuda_event.h"  // before any header that includes CUDAEvent.h

#include <ATen/Parallel.h>
// The host allocator's header trips GCC's -Winterference-size as CUDAEvent.h does (cuda_event.h).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"
#include <ATen/core/CachingHostAllocator.h>
#pragma GCC diagnostic pop
#else
#include <ATen/core/CachingHostAllocator.h>
#endif
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <utility>

#include "copy_layout.h"
#include "cpu/scatter_cpu.h"
#include "cuda/multi_copy.h"
#include "cuda/peer_access.h"
#include "cuda/pinned_pool.h"

namespace fastdp {
namespace {

// NOTE [ Stream order of host copies ]
// Pinned chunks are copied on the destination's current stream, as torch's .to() copies them: one
// cudaMemcpyAsync per dense chunk (cudaMemcpy2DAsync for rows of one strided dim), never read by
// the host, so a batch still being filled by a non_blocking copy on that stream is read after it
// lands; torch's host allocator records the stream on their blocks. Pageable chunks cannot be
// the target of a pending copy (CUDA finishes copies into pageable memory before returning): they
// are packed on the host now and sent on the device's copy stream; the current stream waits on an
// event for them and the buffer is recorded for it. Under CUDA graph capture everything stays on
// the capturing stream, and pageable sources are refused (a host copy is not replayed).

// One chunk that must be copied: its source view, its destination strides and region.
struct Copy {
  size_t r, i;
  at::Tensor chunk;
  std::vector<int64_t> strides;  // strides torch's .to() gives it
  int64_t offset = 0;            // byte offset of its region in the destination buffer
  int64_t nbytes = 0;
};

int64_t lay_out(const std::vector<Copy*>& copies, int64_t start) {
  int64_t off = start;
  for (Copy* c : copies) {
    off = align_up(off, kRegionAlign);
    c->offset = off;
    off += c->nbytes;
  }
  return off;
}

// Rows [row0, row0 + rows) of chunk c along its outermost destination dim: a contiguous range of
// its region. dim < 0 when the chunk has at most one element per dim (a single row).
struct Rows {
  int64_t dim = -1, count = 1, bytes = 0;
};

Rows rows_of(const Copy& c) {
  Rows rows;
  rows.bytes = c.nbytes;
  int64_t best = 0;
  for (int64_t k = 0; k < c.chunk.dim(); ++k) {
    if (c.chunk.size(k) > 1 && c.strides[k] > best) {
      best = c.strides[k];
      rows = {k, c.chunk.size(k), c.strides[k] * c.chunk.element_size()};
    }
  }
  return rows;
}

at::Tensor rows_part(const at::Tensor& t, const Rows& rows, int64_t row0, int64_t n) {
  return rows.dim < 0 ? t : t.narrow(rows.dim, row0, n);
}

struct Piece {
  const Copy* c;
  Rows rows;
  int64_t row0, n;
};

// Packs `pieces` into one pinned block and sends them with one H2D on `stream`, or copies them one
// by one through torch when no block is available. `buf` is the destination buffer.
void flush_window(std::vector<Piece>& pieces, int64_t begin, int64_t end, const at::Tensor& buf,
                  const c10::cuda::CUDAStream& stream) {
  if (pieces.empty()) return;
  PinnedBlock block = pinned_acquire(static_cast<size_t>(end - begin));
  auto dst_part = [&](const Piece& p) {
    const int64_t off = p.c->offset + p.row0 * p.rows.bytes;
    const at::Tensor part = rows_part(p.c->chunk, p.rows, p.row0, p.n);
    if (!block) return view_into(buf, off, part.scalar_type(), part.sizes(), p.c->strides);
    return at::from_blob(static_cast<char*>(block.data()) + (off - begin), part.sizes(),
                         p.c->strides, part.options().pinned_memory(false));
  };
  const int64_t n = static_cast<int64_t>(pieces.size());
  auto pack = [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Piece& p = pieces[k];
      dst_part(p).copy_(rows_part(p.c->chunk, p.rows, p.row0, p.n), /*non_blocking=*/true);
    }
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

bool capturing(const c10::cuda::CUDAStream& stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

at::Tensor byte_buffer(int64_t total, c10::DeviceIndex device) {
  return at::empty({total}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
}

// The one outer dim of a strided pinned chunk whose rows are contiguous in both layouts (-1: none).
int64_t row_dim(const Copy& c) {
  const Rows rows = rows_of(c);
  if (rows.dim < 0 || c.chunk.stride(rows.dim) < c.strides[rows.dim]) return -1;
  for (int64_t k = 0; k < c.chunk.dim(); ++k) {
    if (k != rows.dim && c.chunk.size(k) > 1 && c.chunk.stride(k) != c.strides[k]) return -1;
  }
  return rows.dim;
}

// Pinned leaves -> `device`: see NOTE [ Stream order of host copies ].
void scatter_pinned(std::vector<Copy*>& copies, c10::DeviceIndex device,
                    std::vector<std::vector<at::Tensor>>& result) {
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device);
  const int64_t total = lay_out(copies, 0);
  const at::Tensor buf = byte_buffer(total, device);
  c10::cuda::CUDAStreamGuard guard(current);
  for (Copy* c : copies) {
    at::Tensor& out = result[c->r][c->i];
    out = view_into(buf, c->offset, c->chunk.scalar_type(), c->chunk.sizes(), c->strides);
    if (c->nbytes == 0) continue;
    char* dst = static_cast<char*>(buf.data_ptr()) + c->offset;
    const bool lazy = c->chunk.is_conj() || c->chunk.is_neg();  // copy_ materialises those bits
    const int64_t d = lazy ? -1 : c->chunk.is_non_overlapping_and_dense() ? -2 : row_dim(*c);
    const int64_t item = c->chunk.element_size();
    if (d == -2) {
      C10_CUDA_CHECK(cudaMemcpyAsync(dst, c->chunk.const_data_ptr(), c->nbytes,
                                     cudaMemcpyHostToDevice, current));
    } else if (d >= 0) {
      const int64_t width = c->nbytes / c->chunk.size(d);
      C10_CUDA_CHECK(cudaMemcpy2DAsync(dst, c->strides[d] * item, c->chunk.const_data_ptr(),
                                       c->chunk.stride(d) * item, width, c->chunk.size(d),
                                       cudaMemcpyHostToDevice, current));
    } else {
      out.copy_(c->chunk, /*non_blocking=*/true);  // torch's own path for other layouts
      continue;
    }
    const c10::Storage& st = c->chunk.storage();
    at::getHostAllocator(at::kCUDA)->record_event(const_cast<void*>(st.data()),
                                                  st.data_ptr().get_context(), current.unwrap());
  }
}

// Pageable leaves -> `device`: see NOTE [ Pinned staging ].
void scatter_pageable(std::vector<Copy*>& copies, c10::DeviceIndex device,
                      std::vector<std::vector<at::Tensor>>& result) {
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device);
  TORCH_CHECK(!capturing(current), "fastdp.scatter_chunks: a pageable CPU tensor cannot be ",
              "copied to cuda:", static_cast<int>(device), " while a CUDA graph is being captured ",
              "(its host copy would not be replayed): pin it (tensor.pin_memory()) or move it to "
              "the GPU before the capture");
  const c10::cuda::CUDAStream stream = copy_stream(device);
  const int64_t total = lay_out(copies, 0);
  at::Tensor buf;
  {
    c10::cuda::CUDAStreamGuard guard(stream);  // allocated for the copy stream, used on current
    buf = byte_buffer(total, device);
  }
  if (total > 0) buf.record_stream(current);
  for (Copy* c : copies) {
    result[c->r][c->i] =
        view_into(buf, c->offset, c->chunk.scalar_type(), c->chunk.sizes(), c->strides);
  }
  const int64_t window = static_cast<int64_t>(staging_window(static_cast<size_t>(total)));
  std::vector<Piece> pieces;
  int64_t begin = 0, end = 0;
  for (Copy* c : copies) {
    const Rows rows = rows_of(*c);
    for (int64_t row0 = 0; row0 < rows.count && c->nbytes > 0;) {
      const int64_t start = c->offset + row0 * rows.bytes;
      if (!pieces.empty() && start + rows.bytes - begin > window) {
        flush_window(pieces, begin, end, buf, stream);
      }
      if (pieces.empty()) begin = start;
      const int64_t n = std::min(rows.count - row0, (window - (start - begin)) / rows.bytes);
      if (n == 0) {  // one row exceeds the window: torch copies the rest of this chunk itself
        c10::cuda::CUDAStreamGuard guard(stream);
        view_into(buf, start, c->chunk.scalar_type(),
                  rows_part(c->chunk, rows, row0, rows.count - row0).sizes(), c->strides)
            .copy_(rows_part(c->chunk, rows, row0, rows.count - row0), /*non_blocking=*/true);
        break;
      }
      pieces.push_back({c, rows, row0, n});
      end = start + n * rows.bytes;
      row0 += n;
    }
  }
  flush_window(pieces, begin, end, buf, stream);
  at::cuda::CUDAEvent done;
  done.record(stream);
  done.block(current);
}

// CPU leaves -> CUDA device: pinned and pageable chunks in buffers of their own.
void scatter_from_host(std::vector<Copy*>& copies, c10::DeviceIndex device,
                       std::vector<std::vector<at::Tensor>>& result) {
  std::vector<Copy*> pinned, pageable;
  for (Copy* c : copies) (c->chunk.is_pinned() ? pinned : pageable).push_back(c);
  if (!pinned.empty()) scatter_pinned(pinned, device, result);
  if (!pageable.empty()) scatter_pageable(pageable, device, result);
}

// Leaves on GPU `src` -> GPU `device`: one multi_copy pack on src, one peer copy.
void scatter_from_device(std::vector<Copy*>& copies, c10::DeviceIndex src, c10::DeviceIndex device,
                         std::vector<std::vector<at::Tensor>>& result) {
  const c10::cuda::CUDAStream src_stream = c10::cuda::getCurrentCUDAStream(src);
  const c10::cuda::CUDAStream dst_stream = c10::cuda::getCurrentCUDAStream(device);
  TORCH_CHECK(!capturing(src_stream) && !capturing(dst_stream),
              "fastdp.scatter_chunks: copies between GPUs (cuda:", static_cast<int>(src),
              " -> cuda:", static_cast<int>(device), ") are not captured in CUDA graphs by fastdp: "
              "capture on one device, or set FASTDP_DISABLE_EXT=1 for torch's copies");
  const int64_t total = lay_out(copies, 0);
  const at::TensorOptions bytes = at::TensorOptions().dtype(at::kByte);
  at::Tensor buf = at::empty({total}, bytes.device(at::kCUDA, device));
  for (Copy* c : copies) {
    result[c->r][c->i] =
        view_into(buf, c->offset, c->chunk.scalar_type(), c->chunk.sizes(), c->strides);
  }
  if (total == 0) return;
  at::Tensor from;  // what the peer copy reads: the chunk itself when it alone is already packed
  if (copies.size() == 1 && copies[0]->chunk.is_non_overlapping_and_dense() &&
      !copies[0]->chunk.is_conj() && !copies[0]->chunk.is_neg()) {
    from = copies[0]->chunk;
  } else {
    c10::cuda::CUDAGuard guard(src);
    at::Tensor staging = at::empty({total}, bytes.device(at::kCUDA, src));
    std::vector<at::Tensor> srcs;
    std::vector<CopySpec> specs;
    srcs.reserve(copies.size());
    for (Copy* c : copies) {
      srcs.push_back(c->chunk.resolve_conj().resolve_neg());
      specs.push_back({srcs.back().data_ptr(), static_cast<char*>(staging.data_ptr()) + c->offset,
                       srcs.back().element_size(), srcs.back().sizes(), srcs.back().strides(),
                       c->strides});
    }
    for (size_t k : multi_copy(specs, src_stream)) {
      view_into(staging, copies[k]->offset, srcs[k].scalar_type(), srcs[k].sizes(),
                copies[k]->strides)
          .copy_(srcs[k]);
    }
    from = staging;
  }
  // Both layouts start at offset 0: a lone packed chunk is byte for byte its own region.
  peer_copy(buf.data_ptr(), dst_stream, from.data_ptr(), src_stream, static_cast<size_t>(total));
  if (p2p_usable(src, device)) from.record_stream(dst_stream);  // read on the destination stream
}

}  // namespace

std::vector<std::vector<at::Tensor>> scatter_cuda(const std::vector<at::Tensor>& leaves,
                                                  const std::vector<std::vector<int64_t>>& plan,
                                                  const std::vector<int64_t>& dims,
                                                  const std::vector<at::Device>& devices) {
  std::vector<at::Device> devs = devices;
  for (at::Device& d : devs) {
    if (d.is_cuda() && !d.has_index()) d = at::Device(at::kCUDA, c10::cuda::current_device());
    TORCH_CHECK(!d.is_cuda() || d.index() < c10::cuda::device_count(),
                "fastdp.scatter_chunks: expected CUDA device indices below ",
                static_cast<int>(c10::cuda::device_count()), ", got ", d);
  }
  std::vector<std::vector<at::Tensor>> result(devs.size(), std::vector<at::Tensor>(leaves.size()));
  std::vector<Copy> copies;
  copies.reserve(leaves.size() * devs.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    const std::vector<int64_t> offsets = chunk_offsets(plan[i]);
    for (size_t r = 0; r < devs.size(); ++r) {
      at::Tensor chunk = chunk_view(leaves[i], dims[i], plan[i], offsets, r);
      if (devs[r] == leaves[i].device()) {
        result[r][i] = std::move(chunk);  // stays: a view, as torch
      } else if (devs[r].is_cpu()) {
        result[r][i] = chunk.to(devs[r]);  // GPU leaf to a CPU replica: torch's synchronous copy
      } else {
        copies.push_back({r, i, chunk, to_copy_strides(chunk)});
        copies.back().nbytes = chunk.numel() * chunk.element_size();
      }
    }
  }
  // Group by (destination, source); -1 is the CPU. One buffer per group.
  std::map<std::pair<int, int>, std::vector<Copy*>> groups;
  for (Copy& c : copies) {
    const at::Tensor& leaf = leaves[c.i];
    groups[{devs[c.r].index(), leaf.is_cuda() ? leaf.get_device() : -1}].push_back(&c);
  }
  for (auto& [key, group] : groups) {
    if (key.second < 0) {
      scatter_from_host(group, key.first, result);
    } else {
      scatter_from_device(group, key.second, key.first, result);
    }
  }
  return result;
}

}  // namespace fastdp
