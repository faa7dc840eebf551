#include "comm_buckets.h"

#include <c10/core/TensorImpl.h>
#include <c10/core/TensorOptions.h>

namespace fastdp {

namespace {

constexpr size_t kNumDtypes = static_cast<size_t>(at::ScalarType::NumOptions);

// `b` starts right where `a` ends, in the same storage.
bool follows(const at::Tensor& a, const at::Tensor& b) {
  if (a.storage().unsafeGetStorageImpl() != b.storage().unsafeGetStorageImpl()) return false;
  return static_cast<const char*>(b.const_data_ptr()) ==
         static_cast<const char*>(a.const_data_ptr()) + a.nbytes();
}

}  // namespace

bool flat_copyable(const at::Tensor& t) {
  return t.is_contiguous() && !t.is_conj() && !t.is_neg();
}

std::vector<Bucket> take_buckets(at::TensorList tensors, int64_t buffer_size) {
  std::vector<Bucket> done;
  std::vector<Bucket> open(kNumDtypes);
  std::vector<int64_t> open_bytes(kNumDtypes, 0);
  std::vector<bool> seen(kNumDtypes, false);
  std::vector<size_t> first_seen;  // dtypes in order of appearance: a stable flush order
  for (size_t j = 0; j < tensors.size(); ++j) {
    const auto& t = tensors[j];
    const auto dt = static_cast<size_t>(t.scalar_type());
    const int64_t bytes = static_cast<int64_t>(t.nbytes());
    if (!seen[dt]) {
      seen[dt] = true;
      first_seen.push_back(dt);
    }
    // torch's _take_tensors: close the bucket before a tensor that would overflow it.
    if (open_bytes[dt] > 0 && open_bytes[dt] + bytes > buffer_size) {
      done.push_back(std::move(open[dt]));
      open[dt] = Bucket();
      open_bytes[dt] = 0;
    }
    Bucket& b = open[dt];
    b.dtype = t.scalar_type();
    b.index.push_back(static_cast<int64_t>(j));
    b.offset.push_back(b.numel);
    b.numel += t.numel();
    open_bytes[dt] += bytes;
  }
  for (size_t dt : first_seen) {
    if (!open[dt].index.empty()) done.push_back(std::move(open[dt]));
  }
  return done;
}

at::Tensor alias_contiguous(const at::Tensor& base, int64_t offset, at::IntArrayRef sizes) {
  const auto key =
      c10::computeDispatchKey(base.scalar_type(), at::kStrided, base.device());
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()),
                                                   c10::DispatchKeySet(key), base.dtype());
  impl->set_storage_offset(base.storage_offset() + offset);
  impl->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(impl));
}

void unflatten_bucket(const at::Tensor& flat, const Bucket& b, at::TensorList like,
                      std::vector<at::Tensor>& out) {
  for (size_t i = 0; i < b.index.size(); ++i) {
    const auto j = b.index[i];
    out[j] = alias_contiguous(flat, b.offset[i], like[j].sizes());
  }
}

std::vector<Bucket> dense_runs(at::TensorList srcs, const std::vector<std::vector<at::Tensor>>& outs,
                               std::vector<int64_t>& strided) {
  for (const auto& o : outs) {
    TORCH_CHECK(o.size() == srcs.size(), "fastdp: dense_runs: ", o.size(),
                " destination tensors for ", srcs.size(), " sources");
  }
  std::vector<Bucket> runs;
  std::vector<int64_t> open(kNumDtypes, -1);  // dtype -> index into runs of the open run
  for (size_t j = 0; j < srcs.size(); ++j) {
    if (srcs[j].numel() == 0) continue;
    bool copyable = true;
    for (const auto& o : outs) copyable = copyable && flat_copyable(o[j]);
    if (!copyable) {
      strided.push_back(static_cast<int64_t>(j));
      continue;
    }
    const auto dt = static_cast<size_t>(srcs[j].scalar_type());
    bool extend = open[dt] >= 0;
    if (extend) {
      const auto last = runs[open[dt]].index.back();
      for (const auto& o : outs) extend = extend && follows(o[last], o[j]);
    }
    if (!extend) {
      open[dt] = static_cast<int64_t>(runs.size());
      runs.emplace_back();
      runs.back().dtype = srcs[j].scalar_type();
    }
    Bucket& r = runs[open[dt]];
    r.index.push_back(static_cast<int64_t>(j));
    r.offset.push_back(r.numel);
    r.numel += srcs[j].numel();
  }
  return runs;
}

std::vector<std::vector<at::Tensor>> run_aliases(const std::vector<Bucket>& runs,
                                                 const std::vector<std::vector<at::Tensor>>& outs) {
  std::vector<std::vector<at::Tensor>> flats(outs.size());
  for (size_t k = 0; k < outs.size(); ++k) {
    flats[k].reserve(runs.size());
    for (const auto& r : runs) {
      flats[k].push_back(alias_contiguous(outs[k][r.index[0]], 0, {r.numel}));
    }
  }
  return flats;
}

}  // namespace fastdp
