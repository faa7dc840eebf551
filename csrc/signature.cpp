#include "signature.h"

#include <torch/csrc/autograd/function.h>  // complete Node type for the use count

namespace fastdp {
namespace {

inline void mix(uint64_t& h, uint64_t v) {
  // boost::hash_combine widened to 64 bits
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
}

}  // namespace

uint64_t tensor_signature(const std::vector<at::Tensor>& tensors) {
  uint64_t h = tensors.size();
  for (const auto& t : tensors) {
    if (!t.defined()) {
      mix(h, 0xdeadbeefULL);
      continue;
    }
    mix(h, reinterpret_cast<uintptr_t>(t.unsafeGetTensorImpl()));
    const bool has_storage = t.has_storage() && t.layout() == at::kStrided;
    mix(h, has_storage ? reinterpret_cast<uintptr_t>(t.storage().data()) : 0);
    mix(h, has_storage ? static_cast<uint64_t>(t.storage_offset()) : 0);
    mix(h, static_cast<uint64_t>(t.dim()));
    for (auto s : t.sizes()) mix(h, static_cast<uint64_t>(s));
    if (t.layout() == at::kStrided) {
      for (auto s : t.strides()) mix(h, static_cast<uint64_t>(s));
    }
    mix(h, static_cast<uint64_t>(t.scalar_type()));
    mix(h,
        static_cast<uint64_t>(t.device().type()) << 8 | static_cast<uint8_t>(t.device().index()));
    mix(h, static_cast<uint64_t>(t.layout()));
    mix(h, t.requires_grad() ? 1 : 2);
  }
  return h;
}

int64_t grad_fn_use_count(const at::Tensor& t) {
  const auto& fn = t.grad_fn();
  return fn ? static_cast<int64_t>(fn.use_count()) : 0;
}

}  // namespace fastdp
