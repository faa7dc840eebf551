// The only translation unit that includes <torch/extension.h>: Python bindings of fastdp._C.
// Every binding releases the GIL around work that touches no Python object.
#include <torch/extension.h>

#include <optional>

#include "build_info.h"
#include "planner.h"
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
}
