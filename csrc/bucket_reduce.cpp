#include "bucket_reduce.h"

#include <algorithm>

#include <ATen/CachedTensorUtils.h>
#include <ATen/Dispatch.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fastdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The node's saved state: the hooks and each source's layout (for a gradient that never arrived).
// It must not own a replica tensor: the tensors have this node as grad_fn (an uncollectable cycle).
struct BucketState {
  std::shared_ptr<BucketHooks> hooks;
  std::vector<at::Tensor> like;  // empty tensors with each source's dtype/device, sizes below
  std::vector<std::vector<int64_t>> sizes;
  at::Device dest = at::kCPU;
};

// Bucket state in a tensor: compiled autograd hashes every saved_data entry into its cache key and
// hands saved tensors to the node's backward as they are; a capsule cannot be hashed. So the state
// is saved as an empty byte tensor whose storage owns it (the DataPtr's context), read back only
// when the DataPtr's deleter is ours (any copy of that tensor would carry no state: a loud error,
// never a guess).
void release_state(void* ctx) { delete static_cast<std::shared_ptr<BucketState>*>(ctx); }

at::Tensor state_tensor(std::shared_ptr<BucketState> state) {
  auto* owner = new std::shared_ptr<BucketState>(std::move(state));
  at::DataPtr ptr(owner->get(), owner, &release_state, at::kCPU);
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, std::move(ptr), nullptr, false);
  return at::empty({0}, at::kByte).set_(std::move(storage), 0, {0}, {1});
}

BucketState& state_of(const at::Tensor& t) {
  const at::DataPtr& ptr = t.storage().data_ptr();
  TORCH_CHECK(ptr.get_deleter() == &release_state,
              "fastdp bucket node: its saved state tensor was replaced by a copy");
  return *static_cast<std::shared_ptr<BucketState>*>(ptr.get_context())->get();
}

struct Args {  // what forward needs once; nothing of it is kept
  std::vector<at::Tensor> replicas;
  std::shared_ptr<BucketState> state;
};

// NOTE [ Summing in place ]
// A gradient is summed into in place by autograd's own rule for a buffered gradient (InputBuffer's
// can_accumulate_inplace): a plain strided tensor (no subclass, zero-tensor, nested, conj or neg
// bit), dense, this node holds the only reference AND its storage has no other user, and no graph
// is being built (create_graph). One widening, as safe: the storage's other user may be the
// gradient's own view base when nothing else holds that base. Backward formulas return such views
// of their fresh results (Linear's weight: mm(...).t(); a bias: sum(...).view(...)); refusing them
// would send every Linear bucket to the out-of-place sum. A view of a gradient another node still
// reads (finding: `p.view(...)` beside `lin`) has a base with other references and is summed out of
// place, per gradient.
bool only_own_base_shares(const at::Tensor& g) {
  if (g.storage().use_count() != 2 || !g.is_view()) return false;
  const at::TensorBase& base = g._base();
  return base.use_count() == 1 && base.has_storage() &&
         base.storage().unsafeGetStorageImpl() == g.storage().unsafeGetStorageImpl() &&
         !at::caching::is_cached_tensor(at::Tensor(base));  // after use_count: this adds one
}

bool can_sum_into(const at::Tensor& g) {
  return g.layout() == at::kStrided && !at::isTensorSubclassLike(g) && !g._is_zerotensor() &&
         !g.is_nested() && !g.is_conj() && !g.is_neg() && !g.requires_grad() &&
         g.is_non_overlapping_and_dense() &&
         torch::autograd::impl::is_tensor_stealable(g, 1 + at::caching::is_cached_tensor(g)) &&
         g.has_storage() && (g.storage().use_count() == 1 || only_own_base_shares(g));
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

// sums[i] += per_replica[j][i] for j >= first[i] (1 or 2), in that order per element. On a GPU
// one multi-tensor kernel per replica. On the CPU each tensor gets every replica before the next
// (it stays in cache), by a plain loop for float and double, add_ otherwise: add_'s dispatch was
// most of a bucket of small tensors (mlp1000, 4 replicas: 6000 sums, 5.7 -> 2.5 ms a step;
// mlp100: 0.23 -> 0.05 ms).
void add_replicas_into(variable_list& sums, const std::vector<variable_list>& per_replica,
                       const std::vector<uint8_t>& first) {
  if (!sums[0].is_cpu()) {
    for (size_t j = 1; j < per_replica.size(); ++j) {
      variable_list into, from;
      for (size_t i = 0; i < sums.size(); ++i) {
        if (j < first[i]) continue;
        into.push_back(sums[i]);
        from.push_back(per_replica[j][i]);
      }
      if (!into.empty()) at::_foreach_add_(into, from);
    }
    return;
  }
  for (size_t i = 0; i < sums.size(); ++i) {
    at::Tensor& sum = sums[i];
    const bool floating = sum.scalar_type() == at::kFloat || sum.scalar_type() == at::kDouble;
    for (size_t j = first[i]; j < per_replica.size(); ++j) {
      const at::Tensor& g = per_replica[j][i];
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

// Per gradient of replica 0: 1 where the sum goes into it (NOTE [ Summing in place ]), 2 where it
// goes into a fresh g0 + g1 (always under create_graph, where the sum must be differentiable).
std::vector<uint8_t> first_added(const variable_list& replica0) {
  const bool graph = at::GradMode::is_enabled();
  std::vector<uint8_t> first(replica0.size());
  for (size_t i = 0; i < replica0.size(); ++i) {
    first[i] = !graph && can_sum_into(replica0[i]) ? 1 : 2;
  }
  return first;
}

// Each source's gradient summed over the replicas (two or more, all on the destination, strided),
// in replica order per element, as `first` says (first_added).
variable_list sum_replicas(std::vector<variable_list>& per_replica,
                           const std::vector<uint8_t>& first) {
  variable_list sums = std::move(per_replica[0]);
  variable_list shared, second;
  for (size_t i = 0; i < sums.size(); ++i) {
    if (first[i] == 1) continue;
    shared.push_back(sums[i]);
    second.push_back(per_replica[1][i]);
  }
  if (!shared.empty()) {
    variable_list fresh = at::_foreach_add(shared, second);  // never aliases an incoming gradient
    for (size_t i = 0, k = 0; i < sums.size(); ++i) {
      if (first[i] == 2) sums[i] = std::move(fresh[k++]);
    }
  }
  if (at::GradMode::is_enabled()) {
    // create_graph: every later replica by an out-of-place add autograd records (the plain
    // loop and in-place adds would leave replicas 2.. out of the second-order graph).
    for (size_t j = 2; j < per_replica.size(); ++j) sums = at::_foreach_add(sums, per_replica[j]);
    return sums;
  }
  add_replicas_into(sums, per_replica, first);
  return sums;
}

struct BucketReduceFn : public torch::autograd::Function<BucketReduceFn> {
  // `sources` must be an at::TensorList: ExtractVariables treats a std::vector as a non-tensor.
  static variable_list forward(AutogradContext* ctx, std::shared_ptr<Args> args,
                               at::TensorList sources) {
    const size_t n = sources.size();
    ctx->saved_data["n"] = static_cast<int64_t>(n);
    ctx->saved_data["state"] = state_tensor(args->state);  // see "Bucket state in a tensor"
    return args->replicas;
  }

  // `grads` by reference: CppNode passes its own list (moved from the engine) and never reads it
  // again, so moving out of it leaves this node the sole owner of each gradient.
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    BucketState* state = &state_of(ctx->saved_data["state"].toTensor());
    const int64_t n = ctx->saved_data["n"].toInt();
    const int64_t r = static_cast<int64_t>(grads.size()) / n;
    std::vector<int64_t> needed;
    for (int64_t k = 0; k < n; ++k) {
      if (ctx->needs_input_grad(k)) needed.push_back(k);  // indexes variable inputs only
    }
    std::vector<variable_list> per_replica(r);
    bool local = true;
    for (int64_t j = 0; j < r; ++j) {
      per_replica[j].reserve(needed.size());
      for (int64_t k : needed) {
        at::Tensor g = std::move(grads[j * n + k]);  // sole owner where autograd made it
        if (!g.defined()) g = at::zeros(state->sizes[k], state->like[k].options());
        local = local && g.device() == state->dest && g.layout() == at::kStrided;
        per_replica[j].push_back(std::move(g));
      }
    }
    // One replica: reduce_replicas copies it, as the Python node does; a sparse gradient:
    // reduce_replicas sums it as DataParallel does (`_densify_mixed` in fastdp/_reducer.py).
    local = local && r > 1 && !needed.empty();
    std::vector<uint8_t> first;
    if (local) first = first_added(per_replica[0]);
    state->hooks->on_backward(local, std::count(first.begin(), first.end(), 2));
    variable_list sums;
    if (needed.empty()) {
    } else if (!local) {
      sums = state->hooks->reduce_replicas(per_replica);
    } else {
      sums = sum_replicas(per_replica, first);
    }
    variable_list out(n + 1);  // [args (no gradient), sources...]
    for (size_t i = 0; i < needed.size(); ++i) out[needed[i] + 1] = sums[i];
    return out;
  }
};

}  // namespace
}  // namespace fastdp

// The node outlives each backward (NOTE [ Early reduction ] in fastdp/_reducer.py) and saves no
// variables, so there is nothing to release; marking it released would make compiled autograd,
// which reads its saved variables, refuse every backward after the first.
template <>
void torch::autograd::CppNode<fastdp::BucketReduceFn>::release_variables() {}

namespace fastdp {

std::vector<at::Tensor> bucket_reduce_link(const std::vector<at::Tensor>& sources,
                                           const std::vector<at::Tensor>& replicas, at::Device dest,
                                           std::shared_ptr<BucketHooks> hooks) {
  TORCH_CHECK(!sources.empty() && replicas.size() % sources.size() == 0,
              "fastdp.bucket_reduce_link: ", replicas.size(), " replica tensors for ",
              sources.size(), " sources");
  // Only the sources that require grad go through the node: a frozen one's replica tensors stay
  // as they are (no grad_fn), with no mark_non_differentiable (compiled autograd refuses it).
  std::vector<size_t> linked;
  for (size_t k = 0; k < sources.size(); ++k) {
    if (sources[k].requires_grad()) linked.push_back(k);
  }
  if (linked.empty()) return replicas;
  auto state = std::make_shared<BucketState>();
  state->hooks = std::move(hooks);
  state->dest = dest;
  std::vector<at::Tensor> inputs;
  for (size_t k : linked) {
    inputs.push_back(sources[k]);
    state->like.push_back(at::empty({0}, sources[k].options()));
    state->sizes.push_back(sources[k].sizes().vec());
  }
  const size_t n = sources.size();
  auto args = std::make_shared<Args>();
  for (size_t j = 0; j < replicas.size(); j += n) {
    for (size_t k : linked) args->replicas.push_back(replicas[j + k]);
  }
  args->state = state;
  at::AutoGradMode grad_on(true);
  c10::InferenceMode not_inference(false);
  std::vector<at::Tensor> outs = BucketReduceFn::apply(args, at::TensorList(inputs));
  std::vector<at::Tensor> result = replicas;
  for (size_t j = 0, i = 0; j < replicas.size(); j += n) {
    for (size_t k : linked) result[j + k] = outs[i++];
  }
  return result;
}

}  // namespace fastdp
