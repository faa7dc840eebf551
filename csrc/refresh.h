#pragma once
// The per-step refresh of persistent replicas as one C++ autograd Function.
// See NOTE [ Persistent replicas ] in fastdp/_persistent.py for the design.

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace fastdp {

// Persistent replica tensors of one ReplicaSet: tensors[j][k] is source k's tensor on replica j.
// tensors[0] alias the sources' storage (DataParallel's replica 0); the others are copies that
// refresh() overwrites. Owned jointly by Python and the autograd nodes of pending steps.
struct RefreshState {
  std::vector<std::vector<at::Tensor>> tensors;
  // The latest step's token: true from its forward until its backward ran.
  std::shared_ptr<std::atomic<bool>> pending = std::make_shared<std::atomic<bool>>(false);
  // Owner count of the latest Refresh node right after it was made (see grad_fn_use_count).
  int64_t baseline = 0;
};

// Copies sources into tensors[1..] of `state` (CPU: parallel over tensors; CUDA: one foreach
// copy per device on the current stream). No autograd. Sources and tensors must match in shape.
void refresh_copy(RefreshState& state, const std::vector<at::Tensor>& sources);

// One step: refresh_copy under an autograd Function whose outputs are *the persistent tensors
// themselves* (their grad_fn now points at this step's node) and whose backward sums every
// replica's gradient onto the sources' device (differentiable ops, so double backward works).
// Sources that do not require grad give non-differentiable outputs. Sets a new pending token.
void refresh_autograd(const std::shared_ptr<RefreshState>& state,
                      const std::vector<at::Tensor>& sources);

// True while the last refresh_autograd step awaits its backward and its node is still referenced
// by a later node (an owner count above the baseline): overwriting could corrupt that graph.
bool refresh_graph_alive(const RefreshState& state);

}  // namespace fastdp
