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
  // Replicas whose tensors are copies (on another device than the sources); replicas on the
  // sources' own device alias their storage and need no copy. See NOTE [ Persistent replicas ].
  std::vector<int64_t> copy_rows;
  // The latest step's token: true from its forward until its backward ran.
  std::shared_ptr<std::atomic<bool>> pending = std::make_shared<std::atomic<bool>>(false);
  // Owner count of the latest Refresh node right after it was made (see grad_fn_use_count).
  int64_t baseline = 0;
};

// Copies sources into tensors[j] for j in copy_rows (CPU: parallel over tensors; CUDA: one foreach
// copy per device on the current stream). No autograd. Sources and tensors must match in shape.
void refresh_copy(RefreshState& state, const std::vector<at::Tensor>& sources);

// Links the persistent tensors to the sources through ONE autograd node, made once per tensor set
// (grad mode forced on): its outputs are *the persistent tensors themselves*, and its backward
// sums every replica's gradient onto the sources' device (differentiable ops, so double backward
// works). The node holds no saved tensors, so every later step's backward can run through it
// again; steps then cost only refresh_copy. Sources not requiring grad give non-differentiable
// outputs. Also copies (refresh_copy).
void refresh_link(const std::shared_ptr<RefreshState>& state,
                  const std::vector<at::Tensor>& sources);

// Marks a step that may build a graph through the node (cleared by the node's backward).
void refresh_mark_step(RefreshState& state);

// True while a step marked since the last backward is still referenced by a later node (an owner
// count above the baseline after linking): overwriting copies could corrupt that graph.
bool refresh_graph_alive(const RefreshState& state);

}  // namespace fastdp
