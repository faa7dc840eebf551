#pragma once
// Geometry shared by the scatter and gather implementations (CPU and CUDA): which strides torch
// gives a copied tensor, where each chunk lives in a per-device buffer, and tensors over such
// buffers.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "py_hidden.h"

namespace fastdp {

// Byte alignment of every region in a packed per-device buffer (the CUDA allocator's own alignment
// is 512; 256 keeps vectorised kernels and cuBLAS on their fast paths).
constexpr int64_t kRegionAlign = 256;

inline int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Strides of `t.to(<another device>)`: torch's _to_copy with preserve_format keeps the strides of a
// non-overlapping-and-dense tensor and otherwise densifies them in the same order
// (at::infer_dense_strides), which also keeps channels_last.
std::vector<int64_t> to_copy_strides(const at::Tensor& t);

// A tensor of `dtype`, `sizes`, `strides` over `buffer`'s storage starting `byte_offset` bytes past
// buffer.data_ptr(). Shares the storage (so the allocator keeps it alive), has its own version
// counter and no autograd history. byte_offset must be a multiple of the element size.
at::Tensor view_into(const at::Tensor& buffer, int64_t byte_offset, at::ScalarType dtype,
                     at::IntArrayRef sizes, at::IntArrayRef strides);

// The output torch.cat([t.to(destination) for t in tensors], dim) would return, allocated empty on
// `destination` (sizes, strides, dtype and memory format computed by torch's own cat on the meta
// device). Every tensor must have the same dtype (no type promotion in a byte copy).
at::Tensor empty_cat_output(const std::vector<at::Tensor>& tensors, int64_t dim,
                            at::Device destination, const char* op);

// Tensors over one flat buffer at fixed element offsets, sizes and strides, each with its own
// version counter and no autograd history (view_into's). Built once per bucket layout; called once
// per flat (a dense buffer of the dtype the layout was made for, large enough for every tensor).
class FASTDP_PY_HIDDEN FlatViews {
 public:
  FlatViews(std::vector<int64_t> offsets, std::vector<std::vector<int64_t>> sizes,
            std::vector<std::vector<int64_t>> strides);
  std::vector<at::Tensor> operator()(const at::Tensor& flat) const;

 private:
  std::vector<int64_t> offsets_;
  std::vector<std::vector<int64_t>> sizes_, strides_;
  int64_t extent_ = 0;  // elements the views span: flat must hold at least this many
};

// Offsets of every chunk along the split dim: offsets[r] = sum(sizes[0..r)).
std::vector<int64_t> chunk_offsets(const std::vector<int64_t>& sizes);

}  // namespace fastdp
