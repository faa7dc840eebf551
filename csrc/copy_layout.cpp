#include "copy_layout.h"

#include <ATen/ExpandUtils.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <optional>
#include <utility>

namespace fastdp {

std::vector<int64_t> to_copy_strides(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return t.strides().vec();
  return at::infer_dense_strides(t.sizes(), t.strides());
}

at::Tensor view_into(const at::Tensor& buffer, int64_t byte_offset, at::ScalarType dtype,
                     at::IntArrayRef sizes, at::IntArrayRef strides) {
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_INTERNAL_ASSERT(byte_offset % itemsize == 0, "fastdp: misaligned region offset ",
                        byte_offset, " for element size ", itemsize);
  const int64_t base = buffer.storage_offset() * buffer.element_size() + byte_offset;
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(buffer.storage()), buffer.key_set(), caffe2::TypeMeta::fromScalarType(dtype));
  out.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, base / itemsize);
  return out;
}

FlatViews::FlatViews(std::vector<int64_t> offsets, std::vector<std::vector<int64_t>> sizes,
                     std::vector<std::vector<int64_t>> strides)
    : offsets_(std::move(offsets)), sizes_(std::move(sizes)), strides_(std::move(strides)) {
  TORCH_CHECK(sizes_.size() == offsets_.size() && strides_.size() == offsets_.size(),
              "fastdp.FlatViews: expected one size and one stride list per offset (",
              offsets_.size(), "), got ", sizes_.size(), " and ", strides_.size());
  for (size_t i = 0; i < offsets_.size(); ++i) {
    TORCH_CHECK(sizes_[i].size() == strides_[i].size() && offsets_[i] >= 0,
                "fastdp.FlatViews: tensor ", i, " has ", sizes_[i].size(), " sizes, ",
                strides_[i].size(), " strides and offset ", offsets_[i]);
    int64_t last = offsets_[i];  // one past the largest element index it reaches
    bool empty = false;
    for (size_t d = 0; d < sizes_[i].size(); ++d) {
      TORCH_CHECK(sizes_[i][d] >= 0 && strides_[i][d] >= 0,
                  "fastdp.FlatViews: negative size or stride in tensor ", i);
      empty = empty || sizes_[i][d] == 0;
      last += (sizes_[i][d] - 1) * strides_[i][d];
    }
    if (!empty) extent_ = std::max(extent_, last + 1);
  }
}

std::vector<at::Tensor> FlatViews::operator()(const at::Tensor& flat) const {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous() && flat.numel() >= extent_,
              "fastdp.FlatViews: expected a contiguous 1-D flat of at least ", extent_,
              " elements, got sizes ", flat.sizes());
  const int64_t itemsize = flat.element_size();
  std::vector<at::Tensor> out;
  out.reserve(offsets_.size());
  for (size_t i = 0; i < offsets_.size(); ++i) {
    out.push_back(
        view_into(flat, offsets_[i] * itemsize, flat.scalar_type(), sizes_[i], strides_[i]));
  }
  return out;
}

// Contiguous cat output without the meta device: torch.cat of tensors that are all contiguous (and
// suggest no other memory format), of one rank, with equal sizes off `dim`, is contiguous with the
// sizes summed along `dim`. That is the common gather (one output per replica), and it skips the
// meta-device cat, whose kernel turns into torch._refs.cat (Python) once torch._dynamo or
// torch._inductor is imported. Anything else, errors included, takes the meta path below.
static std::optional<std::vector<int64_t>> contiguous_cat_sizes(
    const std::vector<at::Tensor>& tensors, int64_t dim) {
  const at::Tensor& first = tensors[0];
  const int64_t rank = first.dim();
  if (rank == 0 || dim < -rank || dim >= rank) return std::nullopt;
  const int64_t d = dim < 0 ? dim + rank : dim;
  std::vector<int64_t> sizes = first.sizes().vec();
  sizes[d] = 0;
  for (const at::Tensor& t : tensors) {
    if (t.dim() != rank || t.scalar_type() != first.scalar_type() || !t.is_contiguous() ||
        t.suggest_memory_format() != at::MemoryFormat::Contiguous)
      return std::nullopt;
    for (int64_t k = 0; k < rank; ++k)
      if (k != d && t.size(k) != sizes[k]) return std::nullopt;
    sizes[d] += t.size(d);
  }
  return sizes;
}

at::Tensor empty_cat_output(const std::vector<at::Tensor>& tensors, int64_t dim,
                            at::Device destination, const char* op) {
  TORCH_CHECK(!tensors.empty(), op, ": expected at least one tensor, got 0");
  if (auto sizes = contiguous_cat_sizes(tensors, dim)) {
    return at::empty(*sizes, tensors[0].options().device(destination).pinned_memory(false));
  }
  std::vector<at::Tensor> metas;
  metas.reserve(tensors.size());
  const at::Tensor* first = nullptr;  // the first tensor torch.cat does not skip
  for (size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& t = tensors[k];
    const bool skipped = t.dim() == 1 && t.numel() == 0;  // legacy empty tensor
    if (first == nullptr && !skipped) first = &t;
    // torch.cat's own CPU text (the meta kernel words it differently).
    TORCH_CHECK(skipped || first->dim() == t.dim(),
                "Tensors must have same number of dimensions: got ", first->dim(), " and ",
                t.dim());
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), op,
                ": expected every tensor to have dtype ", tensors[0].scalar_type(),
                " (no type promotion), got ", t.scalar_type(), " for tensor ", k);
    // t.to(destination) is t itself on its own device, a dense copy elsewhere.
    const bool stays = t.device() == destination;
    metas.push_back(at::empty_strided(t.sizes(), stays ? t.strides().vec() : to_copy_strides(t),
                                      t.options().device(at::kMeta)));
  }
  const at::Tensor meta = at::cat(metas, dim);
  return at::empty_strided(meta.sizes(), meta.strides(),
                           tensors[0].options().device(destination).pinned_memory(false));
}

std::vector<int64_t> chunk_offsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> offsets(sizes.size(), 0);
  for (size_t r = 1; r < sizes.size(); ++r) offsets[r] = offsets[r - 1] + sizes[r - 1];
  return offsets;
}

}  // namespace fastdp
