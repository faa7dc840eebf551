// The only translation unit that includes <torch/extension.h>: Python bindings of fastdp._C.
// Every binding releases the GIL around work that touches no Python object.
#include <torch/extension.h>

#include <optional>

#include "bucket_reduce.h"
#include "build_info.h"
#include "copy_layout.h"
#include "dict_snapshot.h"
#include "gather.h"
#include "graph_task.h"
#include "held_tensors.h"
#include "host_copy_route.h"
#include "host_pool.h"
#include "scatter.h"
#include "signature.h"
#include "transfer.h"

namespace py = pybind11;

namespace {

bool py_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// A Python callable owned from C++ (an autograd node may die on any thread): released with the
// GIL held, or leaked once the interpreter is finalizing.
struct PyFn {
  py::object fn;
  explicit PyFn(py::object f) : fn(std::move(f)) {}
  PyFn(const PyFn&) = delete;
  PyFn& operator=(const PyFn&) = delete;
  ~PyFn() {
    if (Py_IsInitialized() && !py_finalizing()) {
      py::gil_scoped_acquire gil;
      fn = py::object();
    } else {
      fn.release();
    }
  }
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastdp C++/CUDA core";

  m.def("build_info", &fastdp::build_info,
        "What the extension was built with: list of (key, value) string pairs.");

  // See NOTE [ Replica invalidation ] in fastdp/_snapshots.py.
  py::class_<fastdp::DictSnapshot>(
      m, "DictSnapshot",
      "The key and value objects of some dicts, held and compared by identity; seen by the "
      "garbage collector.",
      py::custom_type_setup(&fastdp::dict_snapshot_type_setup))
      .def(py::init<const py::list&>(), py::arg("dicts"))
      .def("changed", &fastdp::DictSnapshot::changed,
           "Indices of the dicts whose keys or values are no longer the same objects, in order.")
      .def("__len__", &fastdp::DictSnapshot::size);

  // See NOTE [ Tensors a forward changed ] in fastdp/_replica_set.py.
  m.def("held_data_ptrs", &fastdp::held_data_ptrs, py::arg("tensors"),
        "Where each tensor's data starts, packed.");
  m.def("held_changed", &fastdp::held_changed, py::arg("tensors"), py::arg("ptrs"),
        "Whether a tensor's data moved from held_data_ptrs(tensors) or one has a backward hook.");

  m.def(
      "tensor_signature",
      [](const std::vector<at::Tensor>& tensors) {
        py::gil_scoped_release no_gil;
        return fastdp::tensor_signature(tensors);
      },
      py::arg("tensors"),
      "64-bit hash of the identity, storage, shape, strides, dtype, device and requires_grad of "
      "each tensor (not values): persistent replicas are rebuilt when it changes.");

  // See NOTE [ Early reduction ] in fastdp/_reducer.py.
  m.def(
      "bucket_reduce_link",
      [](const std::vector<at::Tensor>& sources, const std::vector<at::Tensor>& replicas,
         at::Device dest, py::object on_backward, py::object reduce_replicas) {
        auto ob = std::make_shared<PyFn>(std::move(on_backward));
        auto rr = std::make_shared<PyFn>(std::move(reduce_replicas));
        auto hooks = std::make_shared<fastdp::BucketHooks>();
        hooks->on_backward = [ob](bool local, int64_t fresh) {
          py::gil_scoped_acquire gil;
          ob->fn(local, fresh);
        };
        hooks->reduce_replicas = [rr](const std::vector<std::vector<at::Tensor>>& per_replica) {
          py::gil_scoped_acquire gil;
          return rr->fn(per_replica).cast<std::vector<at::Tensor>>();
        };
        return fastdp::bucket_reduce_link(sources, replicas, dest, std::move(hooks));
      },
      py::arg("sources"), py::arg("replicas"), py::arg("dest"), py::arg("on_backward"),
      py::arg("reduce_replicas"),
      "One bucket's reduce node: the replica tensors (replica-major) become its outputs; "
      "backward calls on_backward(local, fresh) once, sums same-device replicas itself (one "
      "multi-tensor add per replica; `fresh` of them into new tensors) or calls "
      "reduce_replicas(per_replica), and hands the sums to the sources' gradient edges. Returns "
      "the replica tensors.");

  m.def("graph_task_mode", &fastdp::graph_task_mode,
        "0: no backward runs on this thread; 1: a backward without inputs= (every leaf "
        "accumulates); 2: autograd.grad or backward(inputs=...) (see graph_task_accumulates).");
  m.def(
      "graph_task_accumulates",
      [](const std::vector<at::Tensor>& tensors) {
        py::gil_scoped_release no_gil;
        return fastdp::graph_task_accumulates(tensors);
      },
      py::arg("tensors"),
      "Per tensor, whether the running backward accumulates into its .grad (the engine's "
      "exec_info: backward(inputs=) names it, reached or not; autograd.grad never).");

  // See NOTE [ Persistent replicas ] in fastdp/_replica_set.py.
  m.def("grad_fn_use_count", &fastdp::grad_fn_use_count, py::arg("tensor"),
        "Number of owners of tensor.grad_fn's node (0 without one).");

  // --- scatter / gather ---------------------------------------------------------------------
  m.def(
      "scatter_chunks",
      [](const std::vector<at::Tensor>& leaves, const std::vector<std::vector<int64_t>>& splits,
         const std::vector<int64_t>& dims, const std::vector<at::Device>& devices) {
        py::gil_scoped_release no_gil;
        return fastdp::scatter_chunks(leaves, splits, dims, devices);
      },
      py::arg("leaves"), py::arg("splits"), py::arg("dims"), py::arg("devices"),
      "Fused chunked scatter. result[r][i] is chunk r of leaves[i] (splits[i][r] slices along "
      "dims[i]; dims: one per leaf or a single one for all) on devices[r], equal to "
      "leaves[i].split(splits[i], dim)[r].to(devices[r]): a view when it stays on the leaf's "
      "device, else a view into one buffer per destination device filled by one staged/peer "
      "copy. CUDA results are ordered on each device's current stream.");
  m.def(
      "scatter_chunks",
      [](const std::vector<at::Tensor>& leaves, const std::vector<std::vector<int64_t>>& splits,
         int64_t dim, const std::vector<at::Device>& devices) {
        py::gil_scoped_release no_gil;
        return fastdp::scatter_chunks(leaves, splits, {dim}, devices);
      },
      py::arg("leaves"), py::arg("splits"), py::arg("dim"), py::arg("devices"),
      "scatter_chunks with one dim for every leaf.");
  // See NOTE [ Input chunks written in place ] in fastdp/scatter_gather.py.
  m.def("own_version_views", &fastdp::own_version_views, py::arg("chunks"),
        "Views like chunks, each of a fresh alias of its chunk's base with a version counter of "
        "its own.");
  m.def("split_own_versions", &fastdp::split_own_versions, py::arg("leaves"), py::arg("splits"),
        py::arg("dims"),
        "The one-device scatter, replica-major: chunk 0 a view of each leaf, chunks 1.. "
        "own_version_views (leaves that do not require grad), else split's chunks.");
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
  m.def("_scatter_window", &fastdp::scatter_window_for, py::arg("total"), py::arg("capacity"),
        "Diagnostics: the window of a pageable host-to-GPU scatter of `total` bytes.");
  m.def("_staged_copy_window", &fastdp::staged_copy_window, py::arg("total"), py::arg("capacity"),
        "Diagnostics: the window of a GPU-to-GPU copy staged through the host (no usable P2P).");
  py::class_<fastdp::FlatViews>(
      m, "FlatViews",
      "Tensors over a flat buffer at fixed element offsets, sizes and strides, each with its own "
      "version counter and no autograd history: built once per bucket layout, called per flat.")
      .def(py::init<std::vector<int64_t>, std::vector<std::vector<int64_t>>,
                    std::vector<std::vector<int64_t>>>(),
           py::arg("offsets"), py::arg("sizes"), py::arg("strides"))
      .def(
          "__call__",
          [](const fastdp::FlatViews& self, const at::Tensor& flat) {
            py::gil_scoped_release no_gil;
            return self(flat);
          },
          py::arg("flat"), "The tensors on `flat` (1-D, contiguous, of the layout's dtype).");
  // `capturing`: see NOTE [ Pinned blocks and graphs ].
  py::class_<fastdp::HostBlockPool>(
      m, "_HostBlockPool",
      "Tests only: the pinned pool's bookkeeping (size classes, free lists, capacity, waits) over "
      "malloc'd host blocks, with events that are flags set by complete() or by a wait.")
      .def(py::init<int64_t>(), py::arg("capacity"))
      .def("acquire", &fastdp::HostBlockPool::acquire, py::arg("bytes"),
           py::arg("capturing") = false,
           "A lent block's handle, 0 when the pool cannot serve the request; `capturing`: as "
           "while a CUDA graph is captured.")
      .def("size", &fastdp::HostBlockPool::size, py::arg("block"))
      .def("record", &fastdp::HostBlockPool::record, py::arg("block"),
           "An outstanding event on the lent block (until complete()); returns its id.")
      .def("complete", &fastdp::HostBlockPool::complete, py::arg("event"))
      .def("completed", &fastdp::HostBlockPool::completed, py::arg("event"))
      .def("release", &fastdp::HostBlockPool::release, py::arg("block"))
      .def("stats", &fastdp::HostBlockPool::stats)
      .def("set_capacity", &fastdp::HostBlockPool::set_capacity, py::arg("bytes"))
      .def("empty_cache", &fastdp::HostBlockPool::empty_cache)
      .def("fail_next_alloc", &fastdp::HostBlockPool::fail_next_alloc, py::arg("how"),
           "The next allocation fails: 'oom' (returns nothing) or 'error' (throws).")
      .def("set_queries_throw", &fastdp::HostBlockPool::set_queries_throw, py::arg("on"),
           "Event queries and waits throw from now on (as after a device fault).")
      .def("queries", &fastdp::HostBlockPool::queries, "Event queries and waits so far.")
      .def("end_capture", &fastdp::HostBlockPool::end_capture,
           "The graph holding the blocks of the capturing acquires since the last call.");
  py::class_<fastdp::HostGraph>(
      m, "_HostGraph",
      "Tests only: a graph of _HostBlockPool's capturing acquires; destroying it (destroy() or "
      "deleting it) returns its blocks to the pool, as CUDA does with a graph's user objects.")
      .def("destroy", &fastdp::HostGraph::destroy, "Returns the blocks; later calls do nothing.")
      .def("blocks", &fastdp::HostGraph::blocks, "Blocks the graph still holds.");
  // See NOTE [ Stream order of host copies ] in cuda/scatter_host_cuda.cu.
  m.def(
      "_host_copy_route",
      [](const std::vector<int64_t>& sizes, const std::vector<int64_t>& src_strides,
         const std::vector<int64_t>& dst_strides, int64_t itemsize, int64_t max_pitch) {
        TORCH_CHECK(sizes.size() == src_strides.size() && sizes.size() == dst_strides.size(),
                    "fastdp._host_copy_route: expected one stride per size");
        const fastdp::HostCopyRoute p =
            fastdp::route_host_copy(sizes, src_strides, dst_strides, itemsize, max_pitch);
        static const char* kinds[] = {"dense", "2d", "rows", "span"};
        py::dict d;
        d["kind"] = kinds[p.kind];
        d["width"] = p.width;
        d["height"] = p.height;
        d["spitch"] = p.spitch;
        d["dpitch"] = p.dpitch;
        d["span"] = p.span;
        d["outer_sizes"] = p.outer_sizes;
        d["outer_sstrides"] = p.outer_sstrides;
        d["outer_dstrides"] = p.outer_dstrides;
        return d;
      },
      py::arg("sizes"), py::arg("src_strides"), py::arg("dst_strides"), py::arg("itemsize"),
      py::arg("max_pitch"), "Diagnostics: how a pinned chunk is copied to a GPU.");
  m.def(
      "_stage_rows",
      [](const std::vector<int64_t>& sizes, const std::vector<int64_t>& dst_strides,
         int64_t itemsize, int64_t window) {
        TORCH_CHECK(sizes.size() == dst_strides.size(),
                    "fastdp._stage_rows: expected one stride per size");
        const fastdp::StageRows r = fastdp::stage_rows(sizes, dst_strides, itemsize, window);
        return py::make_tuple(r.dim, r.count, r.bytes, r.outer);
      },
      py::arg("sizes"), py::arg("dst_strides"), py::arg("itemsize"), py::arg("window"),
      "Diagnostics: (dim, count, bytes, outer dims) of the rows a pageable chunk is staged by.");
  // --- end scatter / gather ----------------------------------------------------------------------
}
