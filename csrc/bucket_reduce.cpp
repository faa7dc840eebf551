#include "bucket_reduce.h"

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

// Whether every gradient of `row` can be summed into in place, by AccumulateGrad's rule for
// stealing one (impl::is_tensor_stealable): this node holds the only reference, it is dense (no
// expanded view) and strided, and no graph is being built (create_graph). A gradient that flows
// to several places is shared, so its count is above 1. Saves an allocation per tensor.
bool sole_owner(const variable_list& row) {
  if (at::GradMode::is_enabled()) return false;
  for (const at::Tensor& g : row) {
    if (g.use_count() != 1 || g.layout() != at::kStrided || !g.is_non_overlapping_and_dense() ||
        g.requires_grad())
      return false;
  }
  return true;
}

// sums += row: one multi-tensor kernel on a GPU; on the CPU, where _foreach_add_ loops over the
// tensors with more checks than add_ (~1.2 vs ~0.55 us per small tensor), add_ in turn.
void add_into(variable_list& sums, const variable_list& row) {
  if (!sums.empty() && sums[0].is_cpu()) {
    for (size_t i = 0; i < sums.size(); ++i) sums[i].add_(row[i]);
  } else {
    at::_foreach_add_(sums, row);
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
        local = local && g.device() == state->dest;
        rows[j].push_back(std::move(g));
      }
    }
    local = local && r > 1;  // one row: reduce_rows copies it, as the Python node does
    state->hooks->on_backward(local);
    variable_list sums;
    if (needed.empty()) {
    } else if (!local) {
      sums = state->hooks->reduce_rows(rows);
    } else if (sole_owner(rows[0])) {  // sum into row 0's gradients: nothing else sees them
      sums = std::move(rows[0]);
      for (int64_t j = 1; j < r; ++j) add_into(sums, rows[j]);
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
