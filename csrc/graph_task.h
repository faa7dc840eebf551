#pragma once
// What the running backward will do with leaves: the engine's own record (GraphTask's exec_info),
// for the reducer's zero-filling of buckets a backward did not reach (NOTE [ Unreached buckets ]
// in fastdp/_reducer.py).

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fastdp {

// 0: no backward is running on this thread; 1: a `.backward()` without `inputs=` (every leaf
// of the graph accumulates); 2: `autograd.grad` or `.backward(inputs=...)` (only what the
// caller named: see graph_task_accumulates).
int64_t graph_task_mode();

// Per tensor: whether the running backward accumulates into its `.grad` (a leaf requiring grad
// that the backward was asked for, reachable or not, as DataParallel's zeros for an unused
// parameter). False outside a backward and for tensors `autograd.grad` captures.
std::vector<bool> graph_task_accumulates(const std::vector<at::Tensor>& tensors);

}  // namespace fastdp
