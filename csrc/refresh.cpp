#include "refresh.h"

#include <ATen/Parallel.h>
#include <ATen/core/custom_class.h>
#include <torch/csrc/autograd/custom_function.h>

#include "signature.h"

namespace fastdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void copy_all(const std::vector<at::Tensor>& dests, const std::vector<at::Tensor>& sources) {
  TORCH_CHECK(dests.size() == sources.size(), "fastdp.refresh: ", dests.size(),
              " replica tensors for ", sources.size(), " sources");
  if (dests.empty()) return;
  if (dests[0].device().is_cpu() && sources[0].device().is_cpu()) {
    at::parallel_for(0, static_cast<int64_t>(dests.size()), 16, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) dests[k].copy_(sources[k]);
    });
  } else {
    at::_foreach_copy_(dests, sources, /*non_blocking=*/true);
  }
}

// Keeps a step's pending token alive in the node's saved_data (an IValue capsule), with the
// layout of each source for the gradients that never arrive. It must not own the RefreshState:
// the state's tensors have this node as grad_fn, and state -> tensor -> node -> state would be a
// reference cycle of C++ owners that nothing collects (the model, replicas and gradients leaked).
struct TokenHolder : torch::CustomClassHolder {
  TokenHolder(std::shared_ptr<std::atomic<bool>> t, const std::vector<at::Tensor>& like)
      : token(std::move(t)) {
    sizes.reserve(like.size());
    strides.reserve(like.size());
    options.reserve(like.size());
    for (const auto& x : like) {
      sizes.push_back(x.sizes().vec());
      strides.push_back(x.strides().vec());
      options.push_back(x.options());
    }
  }
  at::Tensor zeros(size_t k) const {  // the source's layout, as zeros_like(Preserve) gave
    return at::empty_strided(sizes[k], strides[k], options[k]).zero_();
  }
  std::shared_ptr<std::atomic<bool>> token;
  std::vector<std::vector<int64_t>> sizes, strides;
  std::vector<at::TensorOptions> options;
};

struct RefreshFn : public torch::autograd::Function<RefreshFn> {
  // `sources` must be an at::TensorList: ExtractVariables treats a std::vector as a non-tensor.
  static variable_list forward(AutogradContext* ctx, std::shared_ptr<RefreshState> state,
                               at::TensorList sources) {
    refresh_copy(*state, sources.vec());
    const size_t n = sources.size();
    auto token = state->pending;
    ctx->saved_data["n"] = static_cast<int64_t>(n);
    ctx->saved_data["replicas"] = static_cast<int64_t>(state->tensors.size());
    ctx->saved_data["device"] = sources.empty() ? at::Device(at::kCPU) : sources[0].device();
    ctx->saved_data["token"] =
        c10::IValue::make_capsule(c10::make_intrusive<TokenHolder>(token, state->tensors[0]));
    variable_list outs;
    variable_list frozen;
    outs.reserve(n * state->tensors.size());
    for (const auto& dev_tensors : state->tensors) {
      for (size_t k = 0; k < n; ++k) {
        outs.push_back(dev_tensors[k]);
        if (!sources[k].requires_grad()) frozen.push_back(dev_tensors[k]);
      }
    }
    if (!frozen.empty()) ctx->mark_non_differentiable(frozen);
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder = c10::static_intrusive_pointer_cast<TokenHolder>(
        ctx->saved_data["token"].toCapsule());
    holder->token->store(false);
    const int64_t n = ctx->saved_data["n"].toInt();
    const int64_t r = ctx->saved_data["replicas"].toInt();
    const at::Device dev = ctx->saved_data["device"].toDevice();
    std::vector<int64_t> needed;
    for (int64_t k = 0; k < n; ++k) {
      if (ctx->needs_input_grad(k)) needed.push_back(k);  // indexes variable inputs only
    }
    // Per replica, the gradients of the needed sources; DataParallel gives unused parameters
    // zero gradients, so what never arrived is materialized.
    std::vector<variable_list> per(r);
    bool local = true;
    for (int64_t j = 0; j < r; ++j) {
      per[j].reserve(needed.size());
      for (int64_t k : needed) {
        at::Tensor g = grads[j * n + k];
        if (!g.defined()) g = holder->zeros(static_cast<size_t>(k));
        local = local && g.device() == dev;
        per[j].push_back(std::move(g));
      }
    }
    variable_list acc = per[0];
    for (int64_t j = 1; j < r; ++j) {
      if (local && !acc.empty()) {
        acc = at::_foreach_add(acc, per[j]);  // one multi-tensor add per replica
      } else {
        for (size_t i = 0; i < acc.size(); ++i) acc[i] = acc[i] + per[j][i].to(dev);
      }
    }
    variable_list out(n + 1);  // [state (no grad), sources...]
    for (size_t i = 0; i < needed.size(); ++i) out[needed[i] + 1] = acc[i];
    return out;
  }
};

}  // namespace

void refresh_copy(RefreshState& state, const std::vector<at::Tensor>& sources) {
  at::NoGradGuard no_grad;
  for (int64_t j : state.copy_rows) {
    TORCH_CHECK(j > 0 && j < static_cast<int64_t>(state.tensors.size()),
                "fastdp.refresh: copy row ", j, " out of range");
    copy_all(state.tensors[j], sources);
  }
}

void refresh_link(const std::shared_ptr<RefreshState>& state,
                  const std::vector<at::Tensor>& sources) {
  at::AutoGradMode grad_on(true);
  c10::InferenceMode not_inference(false);
  state->pending = std::make_shared<std::atomic<bool>>(false);
  auto outs = RefreshFn::apply(state, at::TensorList(sources));
  state->baseline = 0;
  for (const auto& t : outs) {
    if (t.requires_grad()) {
      state->baseline = grad_fn_use_count(t);
      break;
    }
  }
}

void refresh_mark_step(RefreshState& state) { state.pending->store(true); }

bool refresh_graph_alive(const RefreshState& state) {
  if (!state.pending->load()) return false;
  for (const auto& t : state.tensors[0]) {
    if (t.requires_grad() && t.grad_fn()) return grad_fn_use_count(t) > state.baseline;
  }
  return false;
}

}  // namespace fastdp
