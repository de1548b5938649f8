// Process groups: the host world of simulated ranks (threads on the CPU) and, in CUDA builds, the
// NCCL Communicator (created from a unique id that Python broadcasts over a torch.distributed group,
// or borrowing the group's own ncclComm_t).
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "dlpack.h"
#include "flexep/comm/host_world.h"

#ifdef FLEXEP_WITH_CUDA
#include "flexep/comm/communicator.h"
#include "flexep/cuda/runtime.h"
#endif

namespace flexep::py {

struct StreamScope::Impl {
#ifdef FLEXEP_WITH_CUDA
  explicit Impl(std::uintptr_t s) : guard(reinterpret_cast<cudaStream_t>(s)) {}
  cuda::StreamGuard guard;
#else
  explicit Impl(std::uintptr_t) {}
#endif
};

StreamScope::StreamScope(std::uintptr_t stream) : impl_(std::make_unique<Impl>(stream)) {}
StreamScope::~StreamScope() = default;

void bind_comm(nb::module_& m) {
  nb::class_<ProcessGroup>(m, "ProcessGroup", "A group the library can all-reduce over (bias update).")
      .def_prop_ro("rank", &ProcessGroup::rank)
      .def_prop_ro("size", &ProcessGroup::size)
      .def(
          "all_reduce_sum",
          [](ProcessGroup& g, nb::handle t, const std::string& what) {
            TensorView v = to_view_or_none(t, "t");
            nb::gil_scoped_release release;
            g.all_reduce_sum(v, what);
          },
          nb::arg("t"), nb::arg("what") = "all_reduce_sum", "In-place sum over the group, ascending rank order.")
      .def(
          "barrier",
          [](ProcessGroup& g, const std::string& what) {
            nb::gil_scoped_release release;
            g.barrier(what);
          },
          nb::arg("what") = "barrier");

  nb::class_<HostWorld>(m, "HostWorld", "R simulated ranks in one process (one Python thread per rank).")
      .def(nb::init<int, double>(), nb::arg("size"), nb::arg("timeout_seconds") = 300.0)
      .def_prop_ro("size", &HostWorld::size)
      .def_prop_rw("timeout_seconds", &HostWorld::timeout_seconds, &HostWorld::set_timeout_seconds)
      .def_prop_ro("broken", &HostWorld::broken);

  nb::class_<HostProcessGroup, ProcessGroup>(m, "HostProcessGroup")
      .def(nb::init<std::shared_ptr<HostWorld>, int>(), nb::arg("world"), nb::arg("rank"));

  m.attr("HAS_CUDA") = nb::bool_(
#ifdef FLEXEP_WITH_CUDA
      true
#else
      false
#endif
  );

#ifdef FLEXEP_WITH_CUDA
  m.def("cuda_device_count", &cuda::device_count, "Visible GPUs (0 without a driver).");
  m.def("cuda_pool_peak_bytes", &cuda::pool_peak_bytes, nb::arg("device"),
        "The most device memory the library's allocator held at once since the last reset (bytes).");
  m.def("cuda_reset_pool_peak_bytes", &cuda::reset_pool_peak_bytes, nb::arg("device"));
  m.def("cuda_pool_used_bytes", &cuda::pool_used_bytes, nb::arg("device"),
        "The device memory the library's allocator holds now (bytes; the live tensors' after a sync).");
  nb::class_<Communicator, ProcessGroup>(m, "Communicator",
                                         "The NCCL communicator of an expert-parallel group (one per rank).")
      .def_static("new_unique_id", [] { return unique_id_to_hex(Communicator::new_unique_id()); },
                  "A fresh ncclUniqueId as hex (rank 0 makes it, the group broadcasts it).")
      .def_static(
          "create",
          [](const std::string& id_hex, int rank, int size, int device, double timeout_seconds, int ranks_per_domain) {
            ensure_no_multicast();
            const ncclUniqueId id = unique_id_from_hex(id_hex);
            CommunicatorOptions o;
            o.timeout_seconds = timeout_seconds;
            o.ranks_per_domain = ranks_per_domain;
            nb::gil_scoped_release release;  // collective: every rank blocks here until all arrive
            return std::shared_ptr<Communicator>(Communicator::create(id, rank, size, device, o));
          },
          nb::arg("unique_id"), nb::arg("rank"), nb::arg("size"), nb::arg("device"),
          nb::arg("timeout_seconds") = 300.0, nb::arg("ranks_per_domain") = 0)
      .def_static(
          "borrow",
          [](std::uintptr_t comm, int device, double timeout_seconds, int ranks_per_domain) {
            ensure_no_multicast();
            CommunicatorOptions o;
            o.timeout_seconds = timeout_seconds;
            o.ranks_per_domain = ranks_per_domain;
            nb::gil_scoped_release release;
            return std::shared_ptr<Communicator>(
                Communicator::borrow(reinterpret_cast<ncclComm_t>(comm), device, o));
          },
          nb::arg("comm_ptr"), nb::arg("device"), nb::arg("timeout_seconds") = 300.0, nb::arg("ranks_per_domain") = 0,
          "Borrows an existing ncclComm_t (e.g. ProcessGroupNCCL._comm_ptr()); never destroyed here.")
      .def_prop_ro("device", &Communicator::device)
      .def_prop_ro("local_rank", &Communicator::local_rank)
      .def_prop_ro("domains", &Communicator::domains)
      .def_prop_ro("timeout_seconds", &Communicator::timeout_seconds)
      .def_prop_ro("aborted", &Communicator::aborted);
#endif
}

}  // namespace flexep::py
