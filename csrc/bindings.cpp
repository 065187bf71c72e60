// The only translation unit that sees pybind11 / torch/extension.h: it binds, nothing else.
#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/comm.h"
#include "comm/p2p.h"
#include "comm/p2p_testing.h"
#include "comm/shm/backend.h"
#include "kernels/cpu/cpu_buffer_pool.h"
#include "kernels/kernels.h"
#include "tensor_parallel/functions.h"
#include "tensor_parallel/input_checks.h"

namespace py = pybind11;
using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

namespace {

// Every entry point may wait on a collective: let other Python threads run meanwhile.
using release_gil = py::call_guard<py::gil_scoped_release>;

// An operator's C++ entry with its group name taken as std::string: pybind11 converts a str
// to that, but not to c10::string_view, which is its own class before torch 2.6.
template <typename T>
struct PyArg {
  using type = std::decay_t<T>;
};
template <>
struct PyArg<c10::string_view> {
  using type = std::string;
};
template <typename R, typename... A>
auto py_entry(R (*fn)(A...)) {
  return [fn](typename PyArg<A>::type... args) -> R { return fn(args...); };
}

bool built_with_cuda() {
#ifdef TPCORE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tpcore C++ core: collectives, tensor-parallel autograd functions and kernels";
  m.def("built_with_cuda", &built_with_cuda, "Whether the CUDA kernels were compiled in.");

  py::class_<tpcore::PendingCollective>(m, "PendingCollective",
                                        "A collective in flight; wait() returns its result.")
      .def("wait", &tpcore::PendingCollective::wait, release_gil())
      .def("is_completed", &tpcore::PendingCollective::is_completed,
           "Whether wait() would return at once.");

  // Collectives in flight (eager only); the synchronous collectives, the mappings and the
  // layers are custom operators: torch.ops.tpcore.* (ops/schemas.cpp).
  // Groups arrive as the intrusive_ptr that torch's bindings hold (tpcore::Group converts).
  m.def(
      "all_reduce_inplace_async",
      [](at::Tensor tensor, const ProcessGroupPtr& group) {
        return tpcore::all_reduce_inplace_async(std::move(tensor), group);
      },
      py::arg("tensor"), py::arg("group"), release_gil());
  m.def(
      "all_gather_async",
      [](const at::Tensor& input, int64_t dim, const ProcessGroupPtr& group) {
        return tpcore::all_gather_async(input, dim, group);
      },
      py::arg("input"), py::arg("dim"), py::arg("group"), release_gil());
  m.def(
      "reduce_scatter_async",
      [](const at::Tensor& input, int64_t dim, const ProcessGroupPtr& group) {
        return tpcore::reduce_scatter_async(input, dim, group);
      },
      py::arg("input"), py::arg("dim"), py::arg("group"), release_gil());
  m.def(
      "reduce_scatter_via_all_reduce",
      [](const at::Tensor& input, int64_t dim, const ProcessGroupPtr& group) {
        return tpcore::reduce_scatter_via_all_reduce(input, dim, group);
      },
      py::arg("input"), py::arg("dim"), py::arg("group"), release_gil());

  // Test hooks: stand in for a backend without a collective; cap CUDA grids to exercise
  // the grid-stride loops on small inputs.
  m.def("_collective_fallbacks", &tpcore::collective_fallbacks);
  m.def(
      "_mark_collective_missing",
      [](const ProcessGroupPtr& group, const std::string& op, const at::Tensor& like,
         bool missing) { tpcore::mark_collective_missing(group, op, like, missing); },
      py::arg("group"), py::arg("op"), py::arg("like"), py::arg("missing") = true);
  m.def("_set_max_grid_blocks", &tpcore::set_max_grid_blocks, py::arg("cap"));
  // The CUDA embedding backward's chunked plan, run on the CPU (tests check the plan there).
  m.def("_embedding_backward_chunked_reference", &tpcore::embedding_backward_chunked_reference,
        py::arg("ids"), py::arg("grad"), py::arg("rows"), py::arg("vocab_start"),
        py::arg("padding_idx"));
  // Pipeline point-to-point: sends are (tensor, peer, tag, what), receives (shape, peer, tag,
  // what).
  m.def(
      "batch_isend_irecv",
      [](const ProcessGroupPtr& group,
         const std::vector<std::tuple<at::Tensor, int64_t, int64_t, std::string>>& sends,
         const std::vector<std::tuple<std::vector<int64_t>, int64_t, int64_t, std::string>>& recvs,
         at::ScalarType dtype, at::Device device, bool check_shapes) {
        std::vector<tpcore::P2PSend> s;
        std::vector<tpcore::P2PRecv> r;
        for (const auto& [t, peer, tag, what] : sends) s.push_back({t, peer, tag, what});
        for (const auto& [shape, peer, tag, what] : recvs) r.push_back({shape, peer, tag, what});
        return tpcore::batch_isend_irecv(group, s, r, dtype, device, check_shapes);
      },
      py::arg("group"), py::arg("sends"), py::arg("recvs"), py::arg("dtype"), py::arg("device"),
      py::arg("check_shapes"), release_gil());
  m.def(
      "_coalesced_sends_for_test",
      [](int64_t messages, int64_t fail_at_send) {
        const auto log = tpcore::coalesced_sends_for_test(messages, fail_at_send);
        return std::make_tuple(log.starts, log.ends, log.sends, log.error);
      },
      py::arg("messages"), py::arg("fail_at_send"));
  m.def("release_storage", &tpcore::release_storage, py::arg("tensor"));
  m.def("backward_from", &tpcore::backward_from, py::arg("output"), py::arg("grad"), release_gil());
  // The `tpcore` c10d backend (shared memory on one host); tpcore/_shm_backend.py registers it.
  py::class_<tpcore::shm::ShmBackend, c10d::Backend, c10::intrusive_ptr<tpcore::shm::ShmBackend>>(
      m, "ShmBackend", "c10d backend: collectives through shared memory among ranks of one host")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       double timeout_s, int64_t slot_bytes, int64_t cell_bytes, int cells,
                       int64_t two_step_bytes, int64_t stream_bytes, py::function make_fallback) {
             // The factory may run, and be dropped, on threads without the GIL.
             std::shared_ptr<py::function> fn(new py::function(std::move(make_fallback)),
                                              [](py::function* f) {
                                                py::gil_scoped_acquire gil;
                                                delete f;
                                              });
             auto factory = [fn]() {
               py::gil_scoped_acquire gil;
               return (*fn)().cast<c10::intrusive_ptr<c10d::Backend>>();
             };
             tpcore::shm::Config config;
             config.slot_bytes = static_cast<size_t>(slot_bytes);
             config.cell_bytes = static_cast<size_t>(cell_bytes);
             config.cells = cells;
             config.two_step_bytes = static_cast<size_t>(two_step_bytes);
             if (stream_bytes >= 0) config.stream_bytes = static_cast<size_t>(stream_bytes);
             config.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
             auto without_gil = [](const std::function<void()>& fn) {
               if (PyGILState_Check()) {
                 py::gil_scoped_release nogil;
                 fn();
               } else {
                 fn();
               }
             };
             py::gil_scoped_release nogil;  // rank 0 waits for the others to map the segment
             return c10::make_intrusive<tpcore::shm::ShmBackend>(store, rank, size, config, factory,
                                                                 without_gil);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"),
           py::arg("slot_bytes"), py::arg("cell_bytes"), py::arg("cells"),
           py::arg("two_step_bytes"), py::arg("stream_bytes"), py::arg("make_fallback"))
      .def_property_readonly("fast_ops", &tpcore::shm::ShmBackend::fast_ops)
      .def_property_readonly("fallback_ops", &tpcore::shm::ShmBackend::fallback_ops)
      .def_property_readonly("segment_name", &tpcore::shm::ShmBackend::segment_name);
  // Benchmark hook: `iters` sums of `tensor` over `group` in a C++ loop (no Python between
  // calls); returns the seconds taken, to separate the transport's cost from the caller's.
  m.def(
      "_shm_all_reduce_loop",
      [](const ProcessGroupPtr& group, const at::Tensor& tensor, int64_t iters) {
        auto* shm = tpcore::shm::ShmBackend::of(group, tensor);
        TORCH_CHECK_VALUE(shm && tensor.is_contiguous(),
                          "tpcore: _shm_all_reduce_loop needs a tpcore-backend group and a "
                          "contiguous CPU tensor");
        const auto start = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < iters; ++i) shm->all_reduce_sum(tensor);
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      },
      py::arg("group"), py::arg("tensor"), py::arg("iters"), release_gil());
  // Eager entries of the custom operators (tpcore/_op_entry.py), without torch.ops' Python-side
  // argument boxing: primitives through their typed dispatcher handles, layer ops (whose
  // kernel is CompositeImplicitAutograd, i.e. this very function) called directly.
  auto eager = m.def_submodule("eager_ops", "tpcore's custom operators entered from C++");
  eager.def("all_reduce", py_entry(&tpcore::op::all_reduce), release_gil());
  eager.def("all_gather", py_entry(&tpcore::op::all_gather), release_gil());
  eager.def("reduce_scatter", py_entry(&tpcore::op::reduce_scatter), release_gil());
  eager.def("broadcast", py_entry(&tpcore::op::broadcast), release_gil());
  eager.def("copy_to_tensor_parallel", py_entry(&tpcore::copy_to_tensor_parallel), release_gil());
  eager.def("reduce_from_tensor_parallel", py_entry(&tpcore::reduce_from_tensor_parallel),
            release_gil());
  eager.def("scatter_to_tensor_parallel", py_entry(&tpcore::scatter_to_tensor_parallel),
            release_gil());
  eager.def("gather_from_tensor_parallel", py_entry(&tpcore::gather_from_tensor_parallel),
            release_gil());
  eager.def("scatter_to_sequence_parallel", py_entry(&tpcore::scatter_to_sequence_parallel),
            release_gil());
  eager.def("gather_from_sequence_parallel", py_entry(&tpcore::gather_from_sequence_parallel),
            release_gil());
  eager.def("reduce_scatter_to_sequence_parallel",
            py_entry(&tpcore::reduce_scatter_to_sequence_parallel), release_gil());
  eager.def("column_parallel_linear", py_entry(&tpcore::column_parallel_linear), release_gil());
  eager.def("row_parallel_linear", py_entry(&tpcore::row_parallel_linear), release_gil());
  eager.def("vocab_parallel_embedding", py_entry(&tpcore::vocab_parallel_embedding), release_gil());
  eager.def("vocab_parallel_cross_entropy", py_entry(&tpcore::vocab_parallel_cross_entropy),
            release_gil());
  eager.def("vocab_parallel_linear_cross_entropy",
            py_entry(&tpcore::vocab_parallel_linear_cross_entropy), release_gil());
  eager.def("dropout", py_entry(&tpcore::dropout), release_gil());
  m.def("set_input_checks", &tpcore::set_input_checks, py::arg("enabled"),
        "Turn the value-reading input checks (ids, targets in range) on or off.");
  m.def("input_checks_enabled", &tpcore::input_checks_enabled);
  m.def("empty_cpu_cache", &tpcore::empty_cpu_cache,
        "Free the large CPU buffers tpcore keeps for reuse; returns the bytes released.");
}
