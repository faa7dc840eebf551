// The only translation unit that includes <torch/extension.h>: Python bindings of fastdp._C.
// Every binding releases the GIL around work that touches no Python object.
#include <torch/extension.h>

#include <optional>

#include "build_info.h"
#include "comm.h"
#include "comm_buckets.h"
#include "gather.h"
#include "planner.h"
#include "refresh.h"
#include "scatter.h"
#include "signature.h"
#include "transfer.h"

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

  // ---- Coalesced broadcast / reduce-add (csrc/comm.h) ----
  m.def(
      "broadcast_coalesced",
      [](const std::vector<at::Tensor>& tensors, const std::vector<at::Device>& devices,
         int64_t buffer_size) {
        py::gil_scoped_release no_gil;
        return fastdp::broadcast_coalesced(tensors, devices, buffer_size);
      },
      py::arg("tensors"), py::arg("devices"), py::arg("buffer_size") = 10485760,
      "torch.nn.parallel.comm.broadcast_coalesced: result[0] are `tensors` themselves, result[d] "
      "bit-identical contiguous copies on devices[d] (views into flat per-dtype buckets of at most "
      "buffer_size bytes, own version counters). devices: torch.device objects, all CPU or all "
      "CUDA; one grouped NCCL call for distinct GPUs, device copies for repeated ids.");
  m.def(
      "broadcast_coalesced_into",
      [](const std::vector<at::Tensor>& tensors, const std::vector<std::vector<at::Tensor>>& outs) {
        py::gil_scoped_release no_gil;
        fastdp::broadcast_coalesced_into(tensors, outs);
      },
      py::arg("tensors"), py::arg("outs"),
      "Refreshes persistent copies in place (one call per step): outs[k][j] = tensors[j] for every "
      "destination k. Destinations laid out as buckets (e.g. result[1:] of broadcast_coalesced) "
      "take one NCCL op / copy per bucket; any other layout is copied per tensor. Bumps the "
      "outs' version counters.");
  m.def(
      "reduce_add_coalesced",
      [](const std::vector<std::vector<at::Tensor>>& inputs, at::Device destination,
         int64_t buffer_size) {
        py::gil_scoped_release no_gil;
        return fastdp::reduce_add_coalesced(inputs, destination, buffer_size);
      },
      py::arg("inputs"), py::arg("destination"), py::arg("buffer_size") = 10485760,
      "torch.nn.parallel.comm.reduce_add_coalesced: result[j] = inputs[0][j] + inputs[1][j] + ... "
      "(list order, each add rounded to the dtype) on `destination`, a torch.device holding one "
      "input list. Dense tensors only; one grouped NCCL reduce between distinct GPUs.");
  m.def(
      "coalesced_supported",
      [](const std::vector<at::Tensor>& tensors, bool reduce) {
        return fastdp::coalesced_supported(tensors, reduce);
      },
      py::arg("tensors"), py::arg("reduce") = false,
      "Whether broadcast_coalesced(_into) (reduce=False) or reduce_add_coalesced (reduce=True) "
      "serves all these tensors: strided layout and a supported dtype. Else use the torch path.");
  m.def(
      "_coalesced_runs",
      [](const std::vector<at::Tensor>& tensors, const std::vector<std::vector<at::Tensor>>& outs) {
        std::vector<int64_t> strided;
        std::vector<std::vector<int64_t>> runs;
        for (const auto& r : fastdp::dense_runs(tensors, outs, strided)) runs.push_back(r.index);
        return std::make_pair(runs, strided);
      },
      py::arg("tensors"), py::arg("outs"),
      "Diagnostics: how broadcast_coalesced_into's CUDA path groups `outs` (index lists of the "
      "runs refreshed by one flat copy / NCCL op each, and the indices copied one by one).");
  m.def(
      "nccl_available",
      []() { return fastdp::nccl_available(); },
      "Whether this build links NCCL (used by the coalesced ops for distinct GPUs).");
  m.def(
      "nccl_comm_info",
      [](const std::vector<int64_t>& devices) {
        py::gil_scoped_release no_gil;
        return fastdp::nccl_comm_info(devices);
      },
      py::arg("devices"),
      "The cached NCCL communicators for CUDA device indices `devices` (rank order), created on "
      "first use: a list of (cuda device, rank, number of ranks). Raises without NCCL.");
  // --- scatter / gather (issue 3) ---------------------------------------------------------------
  m.def(
      "scatter_chunks",
      [](const std::vector<at::Tensor>& leaves, const std::vector<std::vector<int64_t>>& plan,
         const std::vector<int64_t>& dims, const std::vector<at::Device>& devices) {
        py::gil_scoped_release no_gil;
        return fastdp::scatter_chunks(leaves, plan, dims, devices);
      },
      py::arg("leaves"), py::arg("plan"), py::arg("dims"), py::arg("devices"),
      "Fused chunked scatter. result[r][i] is chunk r of leaves[i] (plan[i][r] slices along "
      "dims[i]; dims: one per leaf or a single one for all) on devices[r], equal to "
      "leaves[i].split(plan[i], dim)[r].to(devices[r]): a view when it stays on the leaf's device, "
      "else a view into one buffer per destination device filled by one staged/peer copy. CUDA "
      "results are ordered on each device's current stream.");
  m.def(
      "scatter_chunks",
      [](const std::vector<at::Tensor>& leaves, const std::vector<std::vector<int64_t>>& plan,
         int64_t dim, const std::vector<at::Device>& devices) {
        py::gil_scoped_release no_gil;
        return fastdp::scatter_chunks(leaves, plan, {dim}, devices);
      },
      py::arg("leaves"), py::arg("plan"), py::arg("dim"), py::arg("devices"),
      "scatter_chunks with one dim for every leaf.");
  m.def(
      "gather_into",
      [](const std::vector<at::Tensor>& tensors, int64_t dim, at::Device destination) {
        py::gil_scoped_release no_gil;
        return fastdp::gather_into(tensors, dim, destination);
      },
      py::arg("tensors"), py::arg("dim"), py::arg("destination"),
      "torch.cat([t.to(destination) for t in tensors], dim) with one output allocation and one "
      "copy per tensor straight into its slice. All tensors share one dtype.");
  m.def(
      "pinned_pool_stats",
      []() {
        py::gil_scoped_release no_gil;
        return fastdp::pinned_pool_stats();
      },
      "Counters of the pinned staging pool as (key, bytes-or-count) pairs: capacity, reserved, "
      "lent, in_flight, blocks, allocations. Empty in a CPU-only build.");
  m.def(
      "pinned_pool_set_capacity",
      [](int64_t bytes) {
        py::gil_scoped_release no_gil;
        return fastdp::pinned_pool_set_capacity(bytes);
      },
      py::arg("bytes"),
      "Set the pinned pool's capacity in bytes (0 disables staging); returns the previous one.");
  m.def(
      "pinned_pool_empty_cache",
      []() {
        py::gil_scoped_release no_gil;
        fastdp::pinned_pool_empty_cache();
      },
      "Free every idle pinned staging block (lent and in-flight blocks stay).");
  m.def(
      "peer_access",
      [](int64_t a, int64_t b) {
        py::gil_scoped_release no_gil;
        return fastdp::peer_access(a, b);
      },
      py::arg("a"), py::arg("b"),
      "Whether copies between CUDA devices a and b go peer to peer (enabled and verified once; "
      "FASTDP_P2P=0 disables). False in a CPU-only build.");
  m.def("_staging_window", &fastdp::staging_window_for, py::arg("total"), py::arg("capacity"),
        "Diagnostics: the window of a host-staged copy of `total` bytes with a pinned pool of "
        "`capacity` bytes (0: the pool cannot stage it).");
  m.def("_staged_copy_window", &fastdp::staged_copy_window, py::arg("total"), py::arg("capacity"),
        "Diagnostics: the window of a GPU-to-GPU copy staged through the host (no usable P2P).");
  // --- end scatter / gather ----------------------------------------------------------------------
}
