// The whole MoE layer: MoELayer (CPU reference, f32/f64) and, in CUDA builds, CudaMoELayer (bf16
// parameters; gradients per grad_mode). Python's flexep.torch.MoE wraps one of them in a single
// autograd Function: parameters are exported once (zero-copy, the nn.Parameters share this memory),
// forward returns an opaque saved state, and backward returns gradient tensors: fresh ones on the
// CPU and with grad_mode "fresh_bf16_weights" (Python may keep them), or with "accumulate_f32" the
// library's buffers, which the next backward reuses (Python copies them).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "dlpack.h"
#include "flexep/core/config_json.h"
#include "flexep/layer/moe_layer.h"

#ifdef FLEXEP_WITH_CUDA
#include "flexep/cuda/grouped_gemm.h"
#include "flexep/cuda/runtime.h"
#include "flexep/layer/cuda_moe_layer.h"
#endif

namespace flexep::py {

namespace {

DType parse_param_dtype(const std::string& s) {
  const std::optional<DType> t = parse_dtype(s);
  FLEXEP_CHECK_ARG(t.has_value(), "param_dtype", "'", s, "' is not a dtype");
  return *t;
}

#ifdef FLEXEP_WITH_CUDA
GradMode parse_grad_mode(const std::string& s) {
  if (s == "accumulate_f32") return GradMode::accumulate_f32;
  if (s == "fresh_bf16_weights") return GradMode::fresh_bf16_weights;
  throw_argument_error("grad_mode", "'", s,
                       "' is not a gradient mode; expected 'accumulate_f32' or 'fresh_bf16_weights'");
}
#endif

// [(name, value, requires_grad)] in the library's order.
nb::list export_parameters(const std::vector<Parameter*>& ps) {
  nb::list out;
  for (Parameter* p : ps) out.append(nb::make_tuple(p->name, to_python(p->value), p->requires_grad));
  return out;
}

struct CpuState {
  MoEOutput out;
};
#ifdef FLEXEP_WITH_CUDA
struct GpuState {
  CudaMoEOutput out;
};
#endif

// The CPU layer's forward and backward, and the GPU layer's (below): Python's autograd Function
// calls them with the GIL released for the library's work.
nb::tuple cpu_forward(MoELayer& l, nb::handle x, nb::handle padding_mask, bool training) {
  TensorView xv = to_view_or_none(x, "x"), mv = to_view_or_none(padding_mask, "padding_mask");
  auto state = std::make_unique<CpuState>();
  {
    nb::gil_scoped_release release;
    state->out = l.forward(xv, mv, training);
  }
  nb::object aux = state->out.aux_loss ? nb::cast(*state->out.aux_loss) : nb::none();
  nb::object out = to_python(state->out.out);
  return nb::make_tuple(out, aux, std::move(state));
}

nb::tuple cpu_backward(MoELayer& l, const CpuState& state, nb::handle grad_out) {
  TensorView g = to_view_or_none(grad_out, "grad_out");
  // Fresh gradient tensors for this backward: the library allocates a parameter's gradient
  // when it is undefined, so Python receives memory nobody else writes to.
  for (Parameter* p : l.parameters()) p->grad = Tensor();
  Tensor grad_x;
  {
    nb::gil_scoped_release release;
    grad_x = l.backward(state.out, g);
  }
  nb::dict grads;
  for (Parameter* p : l.parameters()) grads[p->name.c_str()] = to_python(p->grad);
  return nb::make_tuple(to_python(grad_x), grads);
}

#ifdef FLEXEP_WITH_CUDA
nb::tuple gpu_forward(CudaMoELayer& l, nb::handle x, nb::handle padding_mask, bool training, std::uintptr_t stream) {
  TensorView xv = to_view_or_none(x, "x"), mv = to_view_or_none(padding_mask, "padding_mask");
  auto state = std::make_unique<GpuState>();
  {
    nb::gil_scoped_release release;
    StreamScope scope(stream);
    state->out = l.forward(xv, mv, training, reinterpret_cast<cudaStream_t>(stream));
  }
  nb::object out = to_python(state->out.out);
  nb::object aux = to_python(state->out.aux_loss);
  return nb::make_tuple(out, aux, std::move(state));
}

nb::tuple gpu_backward(CudaMoELayer& l, GpuState& state, nb::handle grad_out, std::uintptr_t stream) {
  TensorView g = to_view_or_none(grad_out, "grad_out");
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  Tensor grad_x;
  {
    nb::gil_scoped_release release;
    StreamScope scope(stream);
    // zero_grad first: the gradients below are this backward's alone. accumulate_f32: the
    // weight gradients are overwritten, not accumulated (no fill), and Python copies the
    // buffers out before the next backward reuses them. fresh_bf16_weights: new tensors.
    l.zero_grad(s);
    grad_x = l.backward(state.out, g, s);
  }
  nb::dict grads;
  for (Parameter* p : l.parameters()) grads[p->name.c_str()] = to_python(p->grad);
  if (l.grad_mode() == GradMode::fresh_bf16_weights) {
    // Hand them over: Python is now their only owner, and the memory goes when it lets go
    // (an optimizer's zero_grad), not at the next backward.
    nb::gil_scoped_release release;
    StreamScope scope(stream);
    l.zero_grad(s);
  }
  return nb::make_tuple(to_python(grad_x), grads);
}
#endif

void bind_cpu_layer(nb::module_& m) {
  nb::class_<CpuState>(m, "MoELayerState", "What a forward saved for its backward (opaque).");

  nb::class_<MoELayer>(m, "MoELayer", "The MoE layer on the CPU (f32 or f64), one rank of an EP group.")
      .def(
          "__init__",
          [](MoELayer* self, const std::string& moe_json, const std::string& backend_json,
             std::shared_ptr<TokenDispatcher> dispatcher, const std::string& param_dtype, std::uint64_t seed,
             double init_std, std::int64_t pad_multiple) {
            MoELayerOptions o;
            o.param_dtype = parse_param_dtype(param_dtype);
            o.seed = seed;
            o.init_std = init_std;
            o.dispatch.pad_multiple = pad_multiple;
            new (self) MoELayer(moe_config_from_json(moe_json), backend_config_from_json(backend_json),
                                std::move(dispatcher), o);
          },
          nb::arg("moe_json"), nb::arg("backend_json"), nb::arg("dispatcher").none(), nb::arg("param_dtype") = "float32",
          nb::arg("seed") = 1234, nb::arg("init_std") = 0.02, nb::arg("pad_multiple") = 1)
      .def_prop_ro("ep_rank", &MoELayer::ep_rank)
      .def_prop_ro("ep_size", &MoELayer::ep_size)
      .def("parameters", [](MoELayer& l) { return export_parameters(l.parameters()); },
           "[(name, value, requires_grad)]: zero-copy views of the library's parameters.")
      .def("e_score_correction_bias",
           [](MoELayer& l) { return l.gate() ? to_python(l.gate()->e_score_correction_bias()) : nb::none(); })
      .def_prop_rw(
          "aux_loss_scale", [](MoELayer& l) { return l.gate() ? l.gate()->aux_loss_scale : 1.0; },
          [](MoELayer& l, double s) {
            if (l.gate()) l.gate()->aux_loss_scale = s;
          },
          "MoEAuxLossAutoScaler.main_loss_backward_scale for this layer's aux loss.")
      .def("cumulative_load",
           [](MoELayer& l) { return l.gate() ? l.gate()->cumulative_load() : std::vector<std::int64_t>(); })
      .def("forward", &cpu_forward, nb::arg("x"), nb::arg("padding_mask").none() = nb::none(),
           nb::arg("training") = true, "-> (out [T, dim], aux_loss or None, state)")
      .def("backward", &cpu_backward, nb::arg("state"), nb::arg("grad_out"), "-> (grad_x, {name: grad or None})")
      .def(
          "update_bias",
          [](MoELayer& l, ProcessGroup* group) {
            FLEXEP_CHECK(l.gate() != nullptr, "update_bias: the fake balanced gate has no correction bias");
            nb::gil_scoped_release release;
            l.gate()->update_bias(group);
          },
          nb::arg("group").none() = nb::none(),
          "Aux-loss-free balancing: bias += sign(mean load - load) * factor, load summed over `group`.");
}

#ifdef FLEXEP_WITH_CUDA
void bind_cuda_layer(nb::module_& m) {
  nb::class_<GpuState>(m, "CudaMoELayerState");

  nb::class_<CudaMoELayer>(m, "CudaMoELayer", "The MoE layer on one GPU (bf16 parameters).")
      .def(
          "__init__",
          [](CudaMoELayer* self, const std::string& moe_json, const std::string& backend_json,
             std::shared_ptr<TokenDispatcher> dispatcher, int device, std::uint64_t seed, double init_std,
             bool fast_init, std::int64_t pad_multiple, const std::string& grad_mode) {
            CudaMoELayerOptions o;
            o.grad_mode = parse_grad_mode(grad_mode);
            o.device = device;
            o.seed = seed;
            o.init_std = init_std;
            o.fast_init = fast_init;
            o.dispatch.pad_multiple = pad_multiple;
            const MoEConfig moe = moe_config_from_json(moe_json);
            const BackendConfig b = backend_config_from_json(backend_json);
            nb::gil_scoped_release release;
            new (self) CudaMoELayer(moe, b, std::move(dispatcher), o);
          },
          nb::arg("moe_json"), nb::arg("backend_json"), nb::arg("dispatcher").none(), nb::arg("device"),
          nb::arg("seed") = 1234, nb::arg("init_std") = 0.02, nb::arg("fast_init") = false,
          nb::arg("pad_multiple") = 1, nb::arg("grad_mode") = "accumulate_f32",
          "grad_mode: 'accumulate_f32' (f32 gradient buffers, reused by every backward) or "
          "'fresh_bf16_weights' (new gradient tensors per backward, bf16 for the expert weights).")
      .def_prop_ro("ep_rank", &CudaMoELayer::ep_rank)
      .def_prop_ro("ep_size", &CudaMoELayer::ep_size)
      .def_prop_ro("device", &CudaMoELayer::device)
      .def_prop_ro("fresh_grads", [](CudaMoELayer& l) { return l.grad_mode() == GradMode::fresh_bf16_weights; },
                   "True when backward returns new gradient tensors (grad_mode 'fresh_bf16_weights').")
      .def("parameters", [](CudaMoELayer& l) { return export_parameters(l.parameters()); })
      .def(
          "e_score_correction_bias",
          [](CudaMoELayer& l) {
            const Tensor& b = l.e_score_correction_bias();
            return b.defined() ? to_python(b) : nb::none();
          },
          "The correction bias on the device [E] f32 (shared, not copied), or None without one.")
      .def("forward", &gpu_forward, nb::arg("x"), nb::arg("padding_mask").none() = nb::none(),
           nb::arg("training") = true, nb::arg("stream") = 0,
           "-> (out [T, dim] bf16, aux_loss [1] on the device or None, state)")
      .def("backward", &gpu_backward, nb::arg("state"), nb::arg("grad_out"), nb::arg("stream") = 0,
           "-> (grad_x bf16, {name: gradient}): accumulate_f32: f32 buffers valid until the next backward; "
           "fresh_bf16_weights: new tensors Python owns (bf16 for the expert weights, f32 for the rest)")
      .def(
          "load_from",
          [](CudaMoELayer& l, MoELayer& cpu, std::uintptr_t stream) {
            nb::gil_scoped_release release;
            l.load_from(cpu, reinterpret_cast<cudaStream_t>(stream));
          },
          nb::arg("cpu"), nb::arg("stream") = 0,
          "Copies every value (correction bias included) from a CPU layer of the same config and rank.")
      .def(
          "update_bias",
          [](CudaMoELayer& l, ProcessGroup* group, std::uintptr_t stream) {
            nb::gil_scoped_release release;
            l.update_bias(group, reinterpret_cast<cudaStream_t>(stream));
          },
          nb::arg("group").none() = nb::none(), nb::arg("stream") = 0);

  m.def("set_grouped_gemm_own_gemm_min_work", &cuda::set_grouped_gemm_own_gemm_min_work, nb::arg("macs"),
        "Experts with at least this many multiply-adds get their own cuBLAS GEMM, the rest one grouped call "
        "(0: every expert its own; 2**63 - 1: all grouped). Process-wide; for tuning.");
  m.def("grouped_gemm_own_gemm_min_work", &cuda::grouped_gemm_own_gemm_min_work);
}
#endif

}  // namespace

void bind_layer(nb::module_& m) {
  bind_cpu_layer(m);
#ifdef FLEXEP_WITH_CUDA
  bind_cuda_layer(m);
#endif
}

}  // namespace flexep::py
