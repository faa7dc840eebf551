#include "bucket_reduce.h"

#include <ATen/CachedTensorUtils.h>
#include <ATen/Dispatch.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/custom_class.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fastdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The node's saved state: the hooks and each source's layout (for a gradient that never arrived).
// It must not own a replica tensor: the tensors have this node as grad_fn (an uncollectable cycle).
struct BucketState : torch::CustomClassHolder {
  std::shared_ptr<BucketHooks> hooks;
  std::vector<at::Tensor> like;  // empty tensors with each source's dtype/device, sizes below
  std::vector<std::vector<int64_t>> sizes;
  at::Device dest = at::kCPU;
};

struct Args {  // what forward needs once; nothing of it is kept
  std::vector<at::Tensor> replicas;
  c10::intrusive_ptr<BucketState> state;
};

// Whether every gradient of `row` can be summed into in place, by autograd's own rule for
// accumulating into a buffered gradient (InputBuffer's can_accumulate_inplace): a plain strided
// tensor (no subclass, zero-tensor, nested, conj or neg bit), dense, this node holds the only
// reference AND its storage has no other user (a view, e.g. of a gradient that another node
// still reads, shares it), and no graph is being built (create_graph).
bool can_sum_into(const at::Tensor& g) {
  return g.layout() == at::kStrided && !at::isTensorSubclassLike(g) && !g._is_zerotensor() &&
         !g.is_nested() && !g.is_conj() && !g.is_neg() && !g.requires_grad() &&
         g.is_non_overlapping_and_dense() &&
         torch::autograd::impl::is_tensor_stealable(g, 1 + at::caching::is_cached_tensor(g)) &&
         g.has_storage() && g.storage().use_count() == 1;
}

bool sole_owner(const variable_list& row) {
  if (at::GradMode::is_enabled()) return false;
  for (const at::Tensor& g : row) {
    if (!can_sum_into(g)) return false;
  }
  return true;
}

// Whether `g` can be summed into `sum` by a plain loop over their memory: the same floating
// dtype and strides, both dense (so element k of memory is element k of both), CPU, and memory
// that does not overlap. The loop then adds exactly as add_ does (one IEEE add per element).
bool plain_loop_ok(const at::Tensor& sum, const at::Tensor& g) {
  if (g.scalar_type() != sum.scalar_type() || !g.is_cpu() || g.strides() != sum.strides() ||
      g.sizes() != sum.sizes() || !g.is_non_overlapping_and_dense() || g.is_neg())
    return false;
  const char* a = static_cast<const char*>(sum.const_data_ptr());
  const char* b = static_cast<const char*>(g.const_data_ptr());
  const size_t bytes = static_cast<size_t>(sum.numel()) * sum.element_size();
  return a + bytes <= b || b + bytes <= a;
}

// sums[i] += rows[j][i] for j >= 1, in that order per element. On a GPU one multi-tensor kernel
// per row. On the CPU each tensor gets every row before the next (it stays in cache), by a plain
// loop for float and double, add_ otherwise: add_'s dispatch was most of a bucket of small
// tensors (mlp1000, 4 replicas: 6000 sums, 5.7 -> 2.5 ms a step; mlp100: 0.23 -> 0.05 ms).
void add_rows_into(variable_list& sums, const std::vector<variable_list>& rows) {
  if (sums.empty() || !sums[0].is_cpu()) {
    for (size_t j = 1; j < rows.size(); ++j) at::_foreach_add_(sums, rows[j]);
    return;
  }
  for (size_t i = 0; i < sums.size(); ++i) {
    at::Tensor& sum = sums[i];
    const bool floating = sum.scalar_type() == at::kFloat || sum.scalar_type() == at::kDouble;
    for (size_t j = 1; j < rows.size(); ++j) {
      const at::Tensor& g = rows[j][i];
      if (!floating || !plain_loop_ok(sum, g)) {
        sum.add_(g);
        continue;
      }
      const int64_t n = sum.numel();
      AT_DISPATCH_FLOATING_TYPES(sum.scalar_type(), "fastdp_bucket_sum", [&] {
        scalar_t* out = sum.mutable_data_ptr<scalar_t>();
        const scalar_t* in = g.const_data_ptr<scalar_t>();
        for (int64_t k = 0; k < n; ++k) out[k] += in[k];
      });
    }
  }
}

struct BucketReduceFn : public torch::autograd::Function<BucketReduceFn> {
  // `sources` must be an at::TensorList: ExtractVariables treats a std::vector as a non-tensor.
  static variable_list forward(AutogradContext* ctx, std::shared_ptr<Args> args,
                               at::TensorList sources) {
    const size_t n = sources.size();
    ctx->saved_data["n"] = static_cast<int64_t>(n);
    ctx->saved_data["state"] = c10::IValue::make_capsule(args->state);
    variable_list frozen;
    for (size_t i = 0; i < args->replicas.size(); ++i) {
      if (!sources[i % n].requires_grad()) frozen.push_back(args->replicas[i]);
    }
    if (!frozen.empty()) ctx->mark_non_differentiable(frozen);
    return args->replicas;
  }

  // `grads` by reference: CppNode passes its own list (moved from the engine) and never reads it
  // again, so moving out of it leaves this node the sole owner of each gradient.
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    auto state = c10::static_intrusive_pointer_cast<BucketState>(
        ctx->saved_data["state"].toCapsule());
    const int64_t n = ctx->saved_data["n"].toInt();
    const int64_t r = static_cast<int64_t>(grads.size()) / n;
    std::vector<int64_t> needed;
    for (int64_t k = 0; k < n; ++k) {
      if (ctx->needs_input_grad(k)) needed.push_back(k);  // indexes variable inputs only
    }
    std::vector<variable_list> rows(r);
    bool local = true;
    for (int64_t j = 0; j < r; ++j) {
      rows[j].reserve(needed.size());
      for (int64_t k : needed) {
        at::Tensor g = std::move(grads[j * n + k]);  // sole owner where autograd made it
        if (!g.defined()) g = at::zeros(state->sizes[k], state->like[k].options());
        local = local && g.device() == state->dest && g.layout() == at::kStrided;
        rows[j].push_back(std::move(g));
      }
    }
    // One row: reduce_rows copies it, as the Python node does; a sparse gradient: reduce_rows
    // sums it as DataParallel does (NOTE [ Sparse gradients ] in fastdp/reducer.py).
    local = local && r > 1;
    state->hooks->on_backward(local);
    variable_list sums;
    if (needed.empty()) {
    } else if (!local) {
      sums = state->hooks->reduce_rows(rows);
    } else if (sole_owner(rows[0])) {  // sum into row 0's gradients: nothing else sees them
      sums = std::move(rows[0]);
      add_rows_into(sums, rows);
    } else {
      sums = at::_foreach_add(rows[0], rows[1]);  // never aliases an incoming gradient
      for (int64_t j = 2; j < r; ++j) at::_foreach_add_(sums, rows[j]);
    }
    variable_list out(n + 1);  // [args (no gradient), sources...]
    for (size_t i = 0; i < needed.size(); ++i) out[needed[i] + 1] = sums[i];
    return out;
  }
};

}  // namespace

std::vector<at::Tensor> bucket_reduce_link(const std::vector<at::Tensor>& sources,
                                           const std::vector<at::Tensor>& replicas,
                                           at::Device dest, std::shared_ptr<BucketHooks> hooks) {
  TORCH_CHECK(!sources.empty() && replicas.size() % sources.size() == 0,
              "fastdp.bucket_reduce_link: ", replicas.size(), " replica tensors for ",
              sources.size(), " sources");
  auto state = c10::make_intrusive<BucketState>();
  state->hooks = std::move(hooks);
  state->dest = dest;
  for (const auto& s : sources) {
    state->like.push_back(at::empty({0}, s.options()));
    state->sizes.push_back(s.sizes().vec());
  }
  auto args = std::make_shared<Args>();
  args->replicas = replicas;
  args->state = state;
  at::AutoGradMode grad_on(true);
  c10::InferenceMode not_inference(false);
  return BucketReduceFn::apply(args, at::TensorList(sources));
}

}  // namespace fastdp
