// flexep._flexep.MoECompute: the MoE layer as a function of weights given per call, MoECompute on the
// CPU (device -1) or CudaMoECompute on CUDA device `device` (moe_compute.h, cuda_moe_compute.h).
// PyTorch owns every parameter: each call takes {state_dict name: tensor} and views the tensors the
// module holds at that moment (DLPack, zero-copy), the library keeps none of them past the call, and
// backward returns new gradient tensors (owned by Python; the library never writes them again) for
// exactly the weights it was given. Every call runs without the GIL (the library may wait for other
// ranks), the CUDA work on the caller's stream.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "dlpack.h"
#include "flexep/core/config_json.h"
#include "flexep/layer/moe_compute.h"

#ifdef FLEXEP_WITH_CUDA
#include "flexep/layer/cuda_moe_compute.h"
#endif

namespace flexep::py {

namespace {

class PyMoECompute;

// What a forward saved for its backward (opaque to Python): activations and dispatch handles, no
// weights.
struct PyMoEState {
  const PyMoECompute* owner = nullptr;
  Tensor indices, weights;  // the routing the forward used (MoEOutput::indices / weights)
  std::shared_ptr<const MoESaved> cpu;
#ifdef FLEXEP_WITH_CUDA
  std::shared_ptr<const CudaMoESaved> gpu;
#endif
};

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// {name: tensor or None} -> MoEWeights. `keep` holds the DLPack imports for the call: a tensor
// nanobind had to make contiguous lives only as long as its import.
MoEWeights weights_from(const nb::dict& d, std::vector<Tensor>& keep) {
  MoEWeights w;
  for (auto [key, value] : d) {
    const std::string name = nb::cast<std::string>(key);
    TensorView* slot = w.find(name);
    if (!slot)
      throw_argument_error(name, "is not a weight of the MoE layer; its weights are: ", joined(moe_weight_names()));
    if (value.is_none()) continue;
    keep.push_back(to_tensor(value, name));
    *slot = keep.back().view();
  }
  return w;
}

nb::dict gradients_to_python(const MoEGradients& g) {
  nb::dict out;
  for (const auto& [name, t] : g.named()) out[name.c_str()] = to_python(t);
  return out;
}

class PyMoECompute {
 public:
  PyMoECompute(const std::string& moe_json, const std::string& backend_json,
               std::shared_ptr<TokenDispatcher> dispatcher, int device, std::int64_t pad_multiple)
      : device_(device) {
    const MoEConfig moe = moe_config_from_json(moe_json);
    const BackendConfig backend = backend_config_from_json(backend_json);
    FLEXEP_CHECK_ARG(pad_multiple >= 1, "pad_multiple", "must be >= 1, got ", pad_multiple);
    DispatchOptions dispatch;
    dispatch.pad_multiple = pad_multiple;
    if (device < 0) {
      FLEXEP_CHECK_ARG(device == -1, "device", "must be -1 (CPU) or a CUDA device index >= 0, got ", device);
      cpu_ = std::make_unique<MoECompute>(moe, backend, std::move(dispatcher), dispatch);
      return;
    }
#ifdef FLEXEP_WITH_CUDA
    nb::gil_scoped_release release;
    gpu_ = std::make_unique<CudaMoECompute>(moe, backend, std::move(dispatcher), device, dispatch);
#else
    throw_argument_error("device", device, " is a CUDA device, but this build has no CUDA (device -1 is the CPU)");
#endif
  }

  int ep_rank() const { return cpu_ ? cpu_->ep_rank() : gpu_rank(); }
  int ep_size() const { return cpu_ ? cpu_->ep_size() : gpu_size(); }
  int num_local_experts() const { return cpu_ ? cpu_->num_local_experts() : gpu_local(); }
  int device() const { return device_; }
  bool rows_in_place() const {
#ifdef FLEXEP_WITH_CUDA
    if (gpu_) return gpu_->rows_in_place();
#endif
    return false;
  }
  // Only the GPU layer on a local dispatcher can read the tokens in place: elsewhere True is refused
  // rather than ignored.
  void set_rows_in_place(bool on) {
#ifdef FLEXEP_WITH_CUDA
    if (gpu_) {
      gpu_->set_rows_in_place(on);
      FLEXEP_CHECK_ARG(gpu_->rows_in_place() == on, "rows_in_place", "True needs ",
                       CudaMoECompute::rows_in_place_requirements(), "; this one has EP size ", gpu_->ep_size());
      return;
    }
#endif
    FLEXEP_CHECK_ARG(!on, "rows_in_place", "True is a GPU option; this MoECompute runs on the CPU (device -1)");
  }

  nb::list parameter_specs() const {
    nb::list out;
    for (const MoEWeightSpec& s : specs()) {
      nb::list shape;
      for (int i = 0; i < s.shape.rank(); ++i) shape.append(s.shape[i]);
      out.append(nb::make_tuple(s.name, nb::tuple(shape), s.requires_grad));
    }
    return out;
  }

  nb::tuple forward(const nb::dict& weights, nb::handle x, nb::handle padding_mask, bool training,
                    nb::handle routing, std::uintptr_t stream) {
    std::vector<Tensor> keep;
    const MoEWeights w = weights_from(weights, keep);
    const Tensor xt = to_tensor(x, "x");
    const Tensor mask = padding_mask.is_none() ? Tensor() : to_tensor(padding_mask, "padding_mask");
    RoutingOverride r;
    Tensor ri, rw;
    if (!routing.is_none()) {
      nb::tuple pair;
      FLEXEP_CHECK_ARG(nb::try_cast(routing, pair) && pair.size() == 2, "routing",
                       "must be None or a tuple (indices [T, k] int64, weights [T, k] float32)");
      ri = to_tensor(pair[0], "routing.indices");
      // (indices, None): a routing replay (the router gathers its weights at these indices).
      if (!pair[1].is_none()) rw = to_tensor(pair[1], "routing.weights");
      r = {ri, rw};
    }
    auto state = std::make_unique<PyMoEState>();
    state->owner = this;
    Tensor out, aux, load;
    if (cpu_) {
      MoEOutput o;
      {
        nb::gil_scoped_release release;
        o = cpu_->forward(w, xt, mask, training, r);
      }
      out = o.out;
      load = o.expert_load;
      if (o.aux_loss) aux = Tensor::from_vector(std::vector<double>{*o.aux_loss}, {1});
      state->indices = o.indices;
      state->weights = o.weights;
      state->cpu = o.saved;
    } else {
#ifdef FLEXEP_WITH_CUDA
      CudaMoEOutput o;
      {
        nb::gil_scoped_release release;
        StreamScope scope(stream);
        o = gpu_->forward(w, xt, mask, training, r, reinterpret_cast<cudaStream_t>(stream));
      }
      out = o.out;
      aux = o.aux_loss;
      load = o.expert_load;
      state->indices = o.indices;
      state->weights = o.weights;
      state->gpu = o.saved;
#endif
    }
    (void)stream;
    return nb::make_tuple(to_python(out), to_python(aux), to_python(load), std::move(state));
  }

  nb::tuple backward(const nb::dict& weights, const PyMoEState& state, nb::handle grad_out, double aux_loss_scale,
                     std::uintptr_t stream) {
    FLEXEP_CHECK_ARG(state.owner == this, "state", "comes from another MoECompute's forward");
    std::vector<Tensor> keep;
    const MoEWeights w = weights_from(weights, keep);
    const Tensor g = to_tensor(grad_out, "grad_out");
    MoEBackward b;
    if (cpu_) {
      FLEXEP_CHECK_ARG(state.cpu != nullptr, "state", "holds no forward (was it already released?)");
      nb::gil_scoped_release release;
      b = cpu_->backward(w, *state.cpu, g, aux_loss_scale);
    } else {
#ifdef FLEXEP_WITH_CUDA
      FLEXEP_CHECK_ARG(state.gpu != nullptr, "state", "holds no forward (was it already released?)");
      nb::gil_scoped_release release;
      StreamScope scope(stream);
      b = gpu_->backward(w, *state.gpu, g, aux_loss_scale, reinterpret_cast<cudaStream_t>(stream));
#endif
    }
    (void)stream;
    return nb::make_tuple(to_python(b.grad_x), gradients_to_python(b.gradients));
  }

 private:
  std::vector<MoEWeightSpec> specs() const {
#ifdef FLEXEP_WITH_CUDA
    if (gpu_) return gpu_->weight_specs();
#endif
    return cpu_->weight_specs();
  }
#ifdef FLEXEP_WITH_CUDA
  int gpu_rank() const { return gpu_->ep_rank(); }
  int gpu_size() const { return gpu_->ep_size(); }
  int gpu_local() const { return gpu_->num_local_experts(); }
  std::unique_ptr<CudaMoECompute> gpu_;
#else
  int gpu_rank() const { return 0; }
  int gpu_size() const { return 1; }
  int gpu_local() const { return 0; }
#endif
  int device_;
  std::unique_ptr<MoECompute> cpu_;
};

}  // namespace

void bind_moe_compute(nb::module_& m) {
  // Weak-referenceable: whoever holds the autograd graph can check that a state was freed.
  nb::class_<PyMoEState>(m, "MoEComputeState",
                         "What a MoECompute forward saved for its backward (opaque; no weights).",
                         nb::is_weak_referenceable())
      .def(
          "routing", [](const PyMoEState& s) { return nb::make_tuple(to_python(s.indices), to_python(s.weights)); },
          "-> (indices [T, k] int64: the router's selection, padding tokens included; weights [T, k]).");

  nb::class_<PyMoECompute>(
      m, "MoECompute",
      "The MoE layer on weights given per call: device -1 is the CPU reference (x f32, f64 or bf16), device >= 0 "
      "that CUDA device (bf16). Weights are passed as {state_dict name: tensor} to every call and never kept.")
      .def(nb::init<const std::string&, const std::string&, std::shared_ptr<TokenDispatcher>, int, std::int64_t>(),
           nb::arg("moe_json"), nb::arg("backend_json"), nb::arg("dispatcher").none() = nb::none(),
           nb::arg("device") = -1, nb::arg("pad_multiple") = 1)
      .def_prop_ro("ep_rank", &PyMoECompute::ep_rank)
      .def_prop_ro("ep_size", &PyMoECompute::ep_size)
      .def_prop_ro("num_local_experts", &PyMoECompute::num_local_experts)
      .def_prop_ro("device", &PyMoECompute::device)
      .def_prop_rw("rows_in_place", &PyMoECompute::rows_in_place, &PyMoECompute::set_rows_in_place,
                   "GPU, EP size 1: the routed experts read the tokens in place through the dispatch's row table "
                   "(no permuted copy kept for backward) instead of a copy made by the dispatcher.")
      .def("parameter_specs", &PyMoECompute::parameter_specs,
           "[(name, shape, requires_grad)]: the weights forward and backward take, shapes on this rank.")
      .def("forward", &PyMoECompute::forward, nb::arg("weights"), nb::arg("x"),
           nb::arg("padding_mask").none() = nb::none(), nb::arg("training") = true,
           nb::arg("routing").none() = nb::none(), nb::arg("stream") = 0,
           "-> (out [T, dim] (x's dtype), aux_loss [1] or None, expert_load [E] int64, state). routing: None, "
           "(indices [T, k] int64 with -1 for none, weights [T, k] float32) replacing the router for this call, or "
           "(indices, None): a routing replay (moe.enable_routing_replay).")
      .def("backward", &PyMoECompute::backward, nb::arg("weights"), nb::arg("state"), nb::arg("grad_out"),
           nb::arg("aux_loss_scale") = 1.0, nb::arg("stream") = 0,
           "-> (grad_x, {name: gradient}): new tensors, each in its weight's dtype and shape.");
}

}  // namespace flexep::py
