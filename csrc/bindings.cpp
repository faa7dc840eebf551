// The only translation unit that includes <torch/extension.h>: Python bindings of fastdp._C.
// Every binding releases the GIL around work that touches no Python object.
#include <torch/extension.h>

#include <optional>

#include "build_info.h"
#include "planner.h"
#include "refresh.h"
#include "signature.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastdp C++/CUDA core";

  m.def("build_info", &fastdp::build_info,
        "What the extension was built with: list of (key, value) string pairs.");

  m.def(
      "plan_chunks",
      [](const std::vector<int64_t>& leaf_sizes, int64_t num_devices,
         std::optional<std::vector<int64_t>> chunk_sizes) {
        py::gil_scoped_release no_gil;
        return fastdp::plan_chunks(leaf_sizes, num_devices,
                                   chunk_sizes ? &*chunk_sizes : nullptr);
      },
      py::arg("leaf_sizes"), py::arg("num_devices"), py::arg("chunk_sizes") = py::none(),
      "Chunk sizes per leaf (torch.chunk semantics, or the explicit chunk_sizes validated against "
      "every leaf). Raises ValueError when leaves split into different numbers of chunks.");

  m.def(
      "tensor_signature",
      [](const std::vector<at::Tensor>& tensors) {
        py::gil_scoped_release no_gil;
        return fastdp::tensor_signature(tensors);
      },
      py::arg("tensors"),
      "64-bit hash of the identity, storage, shape, strides, dtype, device and requires_grad of "
      "each tensor (not values): persistent replicas are rebuilt when it changes.");

  m.def("grad_fn_use_count", &fastdp::grad_fn_use_count, py::arg("tensor"),
        "Number of owners of tensor.grad_fn's node (0 without one); see NOTE [ Persistent "
        "replicas ].");

  py::class_<fastdp::RefreshState, std::shared_ptr<fastdp::RefreshState>>(
      m, "RefreshState",
      "Persistent replica tensors of one replica set; see NOTE [ Persistent replicas ].")
      .def(py::init<>())
      .def_readwrite("tensors", &fastdp::RefreshState::tensors,
                     "tensors[j][k]: source k on replica j (replica 0 aliases the sources)")
      .def_readwrite("copy_rows", &fastdp::RefreshState::copy_rows,
                     "replicas whose tensors are copies refreshed by copy()/refresh()")
      .def(
          "copy",
          [](fastdp::RefreshState& st, const std::vector<at::Tensor>& sources) {
            py::gil_scoped_release no_gil;
            fastdp::refresh_copy(st, sources);
          },
          "Copy sources into the replicas of copy_rows (no autograd).")
      .def(
          "link",
          [](const std::shared_ptr<fastdp::RefreshState>& st,
             const std::vector<at::Tensor>& sources) {
            py::gil_scoped_release no_gil;
            fastdp::refresh_link(st, sources);
          },
          "Copy, and link every replica tensor to the sources through one reusable autograd node.")
      .def("mark_step", &fastdp::refresh_mark_step,
           "A step that may build a graph through the node (its backward clears it).")
      .def("graph_alive", &fastdp::refresh_graph_alive,
           "Whether the last step's graph may still need the current replica tensors.");
}
