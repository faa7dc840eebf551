#include "graph_task.h"

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace fastdp {

int64_t graph_task_mode() {
  const auto* info = torch::autograd::get_current_graph_task_exec_info();
  if (info == nullptr) return 0;
  return info->empty() ? 1 : 2;
}

std::vector<bool> graph_task_accumulates(const std::vector<at::Tensor>& tensors) {
  std::vector<bool> out(tensors.size(), false);
  const auto* info = torch::autograd::get_current_graph_task_exec_info();
  if (info == nullptr) return out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.defined() || !t.requires_grad() || !t.is_leaf()) continue;
    if (info->empty()) {
      out[i] = true;
      continue;
    }
    // `.backward(inputs=)` marks each input's accumulator needed, reached or not; autograd.grad
    // captures instead (needed_ stays false) and accumulates nothing.
    auto acc = torch::autograd::impl::try_get_grad_accumulator(t);
    if (!acc) continue;
    auto it = info->find(acc.get());
    out[i] = it != info->end() && it->second.needed_;
  }
  return out;
}

}  // namespace fastdp
