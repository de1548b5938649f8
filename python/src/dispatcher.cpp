// TokenDispatcher and its handle. Each call takes DLPack tensors (zero-copy views; the Python
// arguments outlive the call) and returns DLPack tensors that own library memory. The GIL is
// released around every library call: host-backend ranks run as Python threads that meet inside the
// library, and GPU calls may block on NCCL.
#include <nanobind/stl/map.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>


#include "bindings.h"
#include "dlpack.h"
#include "flexep/comm/host_world.h"
#include "flexep/core/config_json.h"
#include "flexep/core/routing.h"
#include "flexep/dispatch/registry.h"

#ifdef FLEXEP_WITH_CUDA
#include "flexep/comm/communicator.h"
#include "flexep/cuda/device_errors.h"
#include "flexep/cuda/multihot.h"
#include "flexep/cuda/runtime.h"
#include "flexep/dispatch/local_cuda.h"
#endif

namespace flexep::py {

namespace {

DispatchOptions make_options(const std::string& mode, std::int64_t budget_rows, const std::string& overflow,
                             std::int64_t pad_multiple, bool check_finite) {
  DispatchOptions o;
  if (mode == "blocking")
    o.mode = DispatchMode::blocking;
  else if (mode == "budget")
    o.mode = DispatchMode::budget;
  else
    throw_argument_error("mode", "is '", mode, "'; allowed: blocking, budget");
  if (overflow == "error")
    o.overflow = OverflowPolicy::error;
  else if (overflow == "drop")
    o.overflow = OverflowPolicy::drop;
  else
    throw_argument_error("overflow", "is '", overflow, "'; allowed: error, drop");
  o.budget_rows = budget_rows;
  o.pad_multiple = pad_multiple;
  o.check_finite = check_finite;
  return o;
}

// The handle as Python sees it: opaque, with its recorded shapes for error messages and tests.
struct PyHandle {
  Handle h;
};

const Handle& unwrap(const PyHandle* h) {
  FLEXEP_CHECK_ARG(h != nullptr && h->h != nullptr, "handle", "is None (dispatch first)");
  return h->h;
}


nb::tuple dispatch(TokenDispatcher& d, nb::handle hidden, nb::handle indices, nb::handle weights,
                   nb::handle routing_map, nb::handle probs, const std::string& mode, std::int64_t budget_rows,
                   const std::string& overflow, std::int64_t pad_multiple, bool check_finite, std::uintptr_t stream) {
  DispatchInput in;
  in.hidden = to_view_or_none(hidden, "hidden");
  in.indices = to_view_or_none(indices, "indices");
  in.weights = to_view_or_none(weights, "weights");
  in.routing_map = to_view_or_none(routing_map, "routing_map");
  in.probs = to_view_or_none(probs, "probs");
  const DispatchOptions o = make_options(mode, budget_rows, overflow, pad_multiple, check_finite);
  const DispatchResult r = on_stream_without_gil(stream, [&] { return d.dispatch(in, o); });
  return nb::make_tuple(to_python(r.tokens), to_python(r.token_probs), to_python(r.tokens_per_expert), r.dropped,
                        PyHandle{r.handle});
}

// DeepEP's layout (docs/semantics.md, "Rank-major dispatch"), with DeepEP's names.
nb::tuple dispatch_rank_major(TokenDispatcher& d, nb::handle hidden, nb::handle indices, nb::handle weights,
                              const std::string& mode, std::int64_t budget_rows, const std::string& overflow,
                              std::int64_t pad_multiple, bool check_finite, std::uintptr_t stream) {
  DispatchInput in;
  in.hidden = to_view_or_none(hidden, "hidden");
  in.indices = to_view_or_none(indices, "indices");
  in.weights = to_view_or_none(weights, "weights");
  DispatchOptions o = make_options(mode, budget_rows, overflow, pad_multiple, check_finite);
  o.layout = DispatchLayout::rank_major;
  const DispatchResult r = on_stream_without_gil(stream, [&] { return d.dispatch(in, o); });
  return nb::make_tuple(to_python(r.tokens), to_python(r.topk_indices), to_python(r.topk_weights),
                        to_python(r.tokens_per_expert), to_python(r.expert_rows), r.dropped, PyHandle{r.handle});
}

std::shared_ptr<TokenDispatcher> make_gpu_dispatcher(const std::string& name, std::shared_ptr<ProcessGroup> comm,
                                                     int num_experts, const std::string& backend_json,
                                                     std::int64_t hidden, std::int64_t max_tokens_per_rank,
                                                     int max_topk) {
  DispatcherSpec spec;
  spec.group = std::move(comm);
  spec.num_experts = num_experts;
  spec.backend = backend_config_from_json(backend_json);
  spec.hidden = hidden;
  spec.max_tokens_per_rank = max_tokens_per_rank;
  spec.max_topk = max_topk;
  // As DeepEP's buffer under Megatron / Automodel: combine and the backwards return without
  // waiting for the GPU; a device error they record is raised by the next blocking dispatch
  // (one after the last dispatch of a run is not; a peer that is gone is, by the next count
  // exchange).
  spec.check_blocking_calls = false;
  FLEXEP_CHECK_ARG(dispatcher_backend(name, "backend.dispatcher").needs_gpu, "backend.dispatcher", "'", name,
                   "' is not a GPU backend; GPU backends built here: ", built_dispatcher_names(true));
  nb::gil_scoped_release release;
  return std::shared_ptr<TokenDispatcher>(make_dispatcher(name, spec));
}

// Runs `cpu` for CPU indices, else `gpu(errors, stream)` on their device, raising the bad ids the
// kernels found (which synchronises `stream`). The GIL is released throughout.
template <class Cpu, class Gpu>
auto on_indices_device(const TensorView& indices, std::uintptr_t stream, const char* op, Cpu cpu, Gpu gpu) {
  nb::gil_scoped_release release;
  if (indices.device.is_cpu()) return cpu();
#ifdef FLEXEP_WITH_CUDA
  StreamScope scope(stream);
  cuda::DeviceGuard guard(indices.device.index);
  cuda::DeviceErrors errors(indices.device.index);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  auto out = gpu(errors, s);
  errors.check(s, op);
  return out;
#else
  (void)stream, (void)op, (void)gpu;
  throw_argument_error("indices", "is on ", indices.device.str(), " but this build has no CUDA");
#endif
}

nb::tuple topk_to_multihot_py(nb::handle indices, nb::handle weights, int num_experts, std::uintptr_t stream) {
  TensorView i = to_view_or_none(indices, "indices"), w = to_view_or_none(weights, "weights");
  const Multihot mh = on_indices_device(i, stream, "topk_to_multihot", [&] { return topk_to_multihot(i, w, num_experts); },
#ifdef FLEXEP_WITH_CUDA
                                        [&](cuda::DeviceErrors& errors, cudaStream_t s) {
                                          return cuda::topk_to_multihot(i, w, num_experts, errors, s);
                                        });
#else
                                        nullptr);
#endif
  return nb::make_tuple(to_python(mh.routing_map), to_python(mh.probs));
}

nb::object multihot_backward_py(nb::handle grad_probs, nb::handle indices, std::uintptr_t stream) {
  TensorView g = to_view_or_none(grad_probs, "grad_probs"), i = to_view_or_none(indices, "indices");
  const Tensor out = on_indices_device(i, stream, "multihot_backward", [&] { return multihot_backward(g, i); },
#ifdef FLEXEP_WITH_CUDA
                                       [&](cuda::DeviceErrors& errors, cudaStream_t s) {
                                         return cuda::multihot_backward(g, i, errors, s);
                                       });
#else
                                       nullptr);
#endif
  return to_python(out);
}

void bind_handle(nb::module_& m) {
  nb::class_<PyHandle>(m, "Handle", "State a dispatch leaves for its combine and both backwards.")
      .def_prop_ro("backend", [](const PyHandle& h) { return unwrap(&h)->backend; })
      .def_prop_ro("rank", [](const PyHandle& h) { return unwrap(&h)->rank; })
      .def_prop_ro("tokens", [](const PyHandle& h) { return unwrap(&h)->tokens; })
      .def_prop_ro("topk", [](const PyHandle& h) { return unwrap(&h)->topk; })
      .def_prop_ro("multihot", [](const PyHandle& h) { return unwrap(&h)->multihot; })
      .def_prop_ro("hidden", [](const PyHandle& h) { return unwrap(&h)->hidden; })
      .def_prop_ro("rows", [](const PyHandle& h) { return unwrap(&h)->rows; })
      .def_prop_ro("local_experts", [](const PyHandle& h) { return unwrap(&h)->local_experts; });
}

void bind_token_dispatcher(nb::module_& m) {
  nb::class_<TokenDispatcher>(m, "TokenDispatcher", "One rank's token dispatcher (every call is collective).")
      .def_prop_ro("backend", [](const TokenDispatcher& d) { return std::string(d.backend()); })
      .def_prop_ro("rank", &TokenDispatcher::rank)
      .def_prop_ro("world_size", &TokenDispatcher::world_size)
      .def_prop_ro("num_experts", &TokenDispatcher::num_experts)
      .def_prop_ro("local_experts", &TokenDispatcher::local_experts)
      .def("dispatch", &dispatch, nb::arg("hidden"), nb::arg("indices") = nb::none(), nb::arg("weights") = nb::none(),
           nb::arg("routing_map") = nb::none(), nb::arg("probs") = nb::none(), nb::arg("mode") = "blocking",
           nb::arg("budget_rows") = 0, nb::arg("overflow") = "error", nb::arg("pad_multiple") = 1,
           nb::arg("check_finite") = true, nb::arg("stream") = 0,
           "-> (tokens [N,H], token_probs [N], tokens_per_expert [E_local], dropped, handle)")
      .def("dispatch_rank_major", &dispatch_rank_major, nb::arg("hidden"), nb::arg("indices"), nb::arg("weights"),
           nb::arg("mode") = "blocking", nb::arg("budget_rows") = 0, nb::arg("overflow") = "error",
           nb::arg("pad_multiple") = 1, nb::arg("check_finite") = true, nb::arg("stream") = 0,
           "DeepEP's rank-major layout -> (recv_x [N,H], recv_topk_idx [N,k] int32, recv_topk_weights [N,k], "
           "tokens_per_expert [E_local], expert_rows int32, dropped, handle); combine then takes [N,H] rows "
           "summed over this rank's experts, dispatch_backward the gradient of recv_topk_weights [N,k]")
      .def(
          "combine",
          [](TokenDispatcher& d, const PyHandle* h, nb::handle expert_out, std::uintptr_t stream) {
            const Handle& handle = unwrap(h);
            TensorView y = to_view_or_none(expert_out, "expert_out");
            const Tensor out = on_stream_without_gil(stream, [&] { return d.combine(handle, y); });
            return to_python(out);
          },
          nb::arg("handle").none(), nb::arg("expert_out"), nb::arg("stream") = 0, "-> out [T, H]")
      .def(
          "dispatch_backward",
          [](TokenDispatcher& d, const PyHandle* h, nb::handle grad_tokens, nb::handle grad_token_probs,
             std::uintptr_t stream) {
            const Handle& handle = unwrap(h);
            TensorView gt = to_view_or_none(grad_tokens, "grad_tokens");
            TensorView gp = to_view_or_none(grad_token_probs, "grad_token_probs");
            const DispatchGrads g = on_stream_without_gil(stream, [&] { return d.dispatch_backward(handle, gt, gp); });
            return nb::make_tuple(to_python(g.hidden), to_python(g.weights));
          },
          nb::arg("handle").none(), nb::arg("grad_tokens"), nb::arg("grad_token_probs"), nb::arg("stream") = 0,
          "-> (grad_hidden [T,H], grad_weights [T,k] or grad_probs [T,E])")
      .def(
          "combine_backward",
          [](TokenDispatcher& d, const PyHandle* h, nb::handle grad_out, std::uintptr_t stream) {
            const Handle& handle = unwrap(h);
            TensorView g = to_view_or_none(grad_out, "grad_out");
            const Tensor out = on_stream_without_gil(stream, [&] { return d.combine_backward(handle, g); });
            return to_python(out);
          },
          nb::arg("handle").none(), nb::arg("grad_out"), nb::arg("stream") = 0, "-> grad_expert_out [N, H]");
}

void bind_factories(nb::module_& m) {
  m.def(
      "make_host_dispatcher",
      [](std::shared_ptr<HostWorld> world, int rank, int num_experts) {
        DispatcherSpec spec;
        spec.group = std::make_shared<HostProcessGroup>(std::move(world), rank);
        spec.num_experts = num_experts;
        return std::shared_ptr<TokenDispatcher>(make_dispatcher("host", spec));
      },
      nb::arg("world"), nb::arg("rank"), nb::arg("num_experts"));
  m.def("make_gpu_dispatcher", &make_gpu_dispatcher, nb::arg("name"), nb::arg("comm"), nb::arg("num_experts"),
        nb::arg("backend_json") = "{}", nb::arg("hidden") = 0, nb::arg("max_tokens_per_rank") = 0,
        nb::arg("max_topk") = 0, "A GPU dispatcher by backend name ('alltoall', 'hybridep', ...) over a Communicator.");
  m.def("gpu_dispatcher_names", [] {
    std::vector<std::string> names;
    for (const DispatcherBackend& b : dispatcher_backends())
      if (b.make && b.needs_gpu) names.emplace_back(b.name);
    return names;
  });
#ifdef FLEXEP_WITH_CUDA
  m.def(
      "make_local_cuda_dispatcher",
      [](int device, int num_experts) {
        return std::shared_ptr<TokenDispatcher>(make_local_cuda_dispatcher(device, num_experts));
      },
      nb::arg("device"), nb::arg("num_experts"), "The single-GPU dispatcher (EP size 1).");
#endif

}

// Routing-form conversions (Hybrid-EP's multihot form): CPU reference, or the GPU kernels when the
// indices live on a GPU.
void bind_routing_forms(nb::module_& m) {
  m.def("topk_to_multihot", &topk_to_multihot_py, nb::arg("indices"), nb::arg("weights"), nb::arg("num_experts"),
        nb::arg("stream") = 0, "-> (routing_map [T,E] bool, probs [T,E])");
  m.def("multihot_backward", &multihot_backward_py, nb::arg("grad_probs"), nb::arg("indices"), nb::arg("stream") = 0,
        "[T,E] gradient gathered back to the k slots (-1 slots get 0).");
}

}  // namespace

void bind_dispatcher(nb::module_& m) {
  bind_handle(m);
  bind_token_dispatcher(m);
  bind_factories(m);
  bind_routing_forms(m);
}

}  // namespace flexep::py
