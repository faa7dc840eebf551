#pragma once
// Flat per-dtype buckets shared by the coalesced broadcast / reduce (csrc/comm.cpp) and their
// CPU and CUDA backends: planning, views into flat buffers, dense-run detection.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastdp {

// One flat bucket: the tensors at positions `index` of the caller's list, all of `dtype`, laid out
// back to back in a contiguous 1-D buffer of `numel` elements; tensor index[i] starts at element
// offset[i]. index is increasing (the caller's order within the dtype).
struct Bucket {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> index;
  std::vector<int64_t> offset;
  int64_t numel = 0;
};

// Groups dense tensors into per-dtype buckets of at most `buffer_size` bytes (a single larger
// tensor gets a bucket of its own): torch.nn.parallel.comm._take_tensors' rule. Every tensor is in
// exactly one bucket, 0-size tensors included. Buckets of one dtype follow the input order.
std::vector<Bucket> take_buckets(at::TensorList tensors, int64_t buffer_size);

// A contiguous tensor of `sizes` starting `offset` elements into `base` (storage_offset relative),
// sharing base's storage: a fresh TensorImpl with its own version counter, no autograd history and
// no view relation (torch's `make_variable(view.tensor_data())` in comm.cpp). No bounds check: the
// caller guarantees that the range lies inside base's storage. Cost: no dispatcher call.
at::Tensor alias_contiguous(const at::Tensor& base, int64_t offset, at::IntArrayRef sizes);

// Unflattens bucket `b` of `flat` into `out`: out[b.index[i]] = alias_contiguous(flat, b.offset[i],
// like[b.index[i]].sizes()). `out` must already have like.size() entries.
void unflatten_bucket(const at::Tensor& flat, const Bucket& b, at::TensorList like,
                      std::vector<at::Tensor>& out);

// Whether one flat copy can fill `t`: plain contiguous, no lazy conj/neg bit.
bool flat_copyable(const at::Tensor& t);

// Maximal runs of tensors whose destinations are laid out like a bucket on EVERY destination k:
// same dtype, contiguous, in one storage, each starting where the previous one (of that dtype, in
// list order) ends: exactly what broadcast_coalesced's outputs look like. Such a run is refreshed
// by one flat copy or NCCL op (the CUDA path of broadcast_coalesced_into). 0-size tensors are
// skipped (nothing to copy); positions with a destination that is not flat_copyable go to
// `strided` and are copied one by one.
std::vector<Bucket> dense_runs(at::TensorList srcs, const std::vector<std::vector<at::Tensor>>& outs,
                               std::vector<int64_t>& strided);

// Whole-bucket flat aliases: result[k][r] is a 1-D alias of runs[r] on destination k.
std::vector<std::vector<at::Tensor>> run_aliases(const std::vector<Bucket>& runs,
                                                 const std::vector<std::vector<at::Tensor>>& outs);

}  // namespace fastdp
