// The harness shared by the multi-GPU backend tests (test_alltoall.cpp, test_hybridep.cpp): test
// configurations, inputs identical for every backend (host tensors), one sequence of calls
// (dispatch, combine, combine_backward, dispatch_backward) on any backend, the host backend's
// results and their bitwise comparison, and the helpers of the errors-on-every-rank tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cpu/dispatch_inputs.h"
#include "cpu/same_bytes.h"
#include "flexep/comm/host_world.h"
#include "flexep/core/plan.h"
#include "flexep/core/random.h"
#include "flexep/core/routing.h"
#include "flexep/core/synthetic_routing.h"
#include "flexep/cuda/permute.h"
#include "flexep/cuda/runtime.h"
#include "flexep/dispatch/host.h"
#include "gpu/multi_gpu.h"

namespace flexep::testing {

struct Config {
  std::string name;
  int experts_per_rank = 2;
  int k = 1;
  std::int64_t hidden = 8;
  std::vector<std::int64_t> tokens = {37, 0, 53, 11};  // per rank (rank r uses tokens[r])
  RoutingSpec routing;
  std::int64_t pad = 1;
  DispatchMode mode = DispatchMode::blocking;
  double budget_fraction = 1.0;  // budget mode: this fraction of the largest rank's required rows
  OverflowPolicy overflow = OverflowPolicy::error;
  bool multihot = false;
  bool separate_stream = false;  // alltoall: NCCL on its own stream
  bool i32_indices = false;
  bool unrouted = false;  // every slot -1: no token goes anywhere, every count is 0
  bool rows_in_place = false;  // DispatchOptions::rows_in_place (backends that cannot ignore it)
};

inline Config config(std::string name, int experts_per_rank, int k, std::int64_t H, std::vector<std::int64_t> tokens,
                     RoutingKind kind = RoutingKind::uniform, std::int64_t pad = 1) {
  Config c;
  c.name = std::move(name);
  c.experts_per_rank = experts_per_rank;
  c.k = k;
  c.hidden = H;
  c.tokens = std::move(tokens);
  c.routing.kind = kind;
  c.routing.zipf_s = 1.2;
  c.pad = pad;
  return c;
}

// ---- inputs (host tensors, identical for every backend) --------------------------------------------

struct Inputs {
  Tensor hidden, indices, weights;  // top-k form (indices i64, or i32 when asked)
  Tensor routing_map, probs;        // multihot form of the same routing
};

inline Inputs make_inputs(const Config& c, int R, int r, std::uint64_t seed = 1234) {
  const int E = c.experts_per_rank * R;
  const std::int64_t T = c.tokens[static_cast<std::size_t>(r)];
  RoutingSpec spec = c.routing;
  spec.hot_expert = E - 1;  // everything goes to the last rank
  TopK tk = synthetic_topk(T, c.k, E, spec, seed, r);
  drop_some_slots(tk.indices);
  if (c.unrouted) std::fill_n(tk.indices.data<std::int64_t>(), tk.indices.numel(), std::int64_t{-1});
  Inputs in;
  in.hidden = random_tensor({T, c.hidden}, DType::bf16, seed + 99, "hidden", r);
  in.indices = c.i32_indices ? tk.indices.to(DType::i32) : tk.indices;
  in.weights = tk.weights;
  Multihot mh = topk_to_multihot(tk.indices, tk.weights, E);
  in.routing_map = mh.routing_map;
  in.probs = mh.probs;
  return in;
}

inline std::vector<std::int64_t> required_rows(const Config& c, int R) {
  std::vector<Tensor> indices;
  for (int r = 0; r < R; ++r) indices.push_back(make_inputs(c, R, r).indices);
  return required_rows_of(indices, c.experts_per_rank * R, c.pad);
}

inline DispatchOptions dispatch_options(const Config& c, int R) {
  DispatchOptions o;
  o.pad_multiple = c.pad;
  o.mode = c.mode;
  o.overflow = c.overflow;
  o.rows_in_place = c.rows_in_place;
  if (c.mode == DispatchMode::budget) {
    std::int64_t most = 0;
    for (std::int64_t n : required_rows(c, R)) most = std::max(most, n);
    const auto b = static_cast<std::int64_t>(static_cast<double>(most) * c.budget_fraction);
    o.budget_rows = b / c.pad * c.pad;
  }
  return o;
}

// ---- one sequence of calls, on any backend ----------------------------------------------------------

struct Outputs {
  Tensor tokens, probs, tokens_per_expert;  // tokens: expert-major (gathered through the table when in place)
  std::int64_t dropped = 0;
  std::int64_t source_rows = -1;  // rows in place: the rows the table points into; -1: copied as usual
  Tensor combined, grad_expert_out, grad_hidden, grad_weights;
};

// up: host tensor -> the backend's device; down: the backend's tensor -> host; dropped: the
// dispatch's drop count (budget mode on a GPU may keep it on the device).
template <class Up, class Down, class Dropped>
Outputs run_sequence(TokenDispatcher& d, const Inputs& in, const Config& c, const DispatchOptions& o, int r, Up up,
                     Down down, Dropped dropped) {
  DispatchInput di;
  const Tensor hidden = up(in.hidden);
  Tensor a, b;
  di.hidden = hidden;
  if (c.multihot) {
    a = up(in.routing_map);
    b = up(in.probs);
    di.routing_map = a;
    di.probs = b;
  } else {
    a = up(in.indices);
    b = up(in.weights);
    di.indices = a;
    di.weights = b;
  }
  DispatchResult res = d.dispatch(di, o);
  Outputs out;
  const bool in_place = o.rows_in_place && o.layout == DispatchLayout::expert_major && res.expert_rows.defined();
  if (in_place) {
    // The rows in place: gathered through the table they must be the expert-major rows.
    out.source_rows = res.tokens.size(0);
    Tensor rows = Tensor::empty({res.expert_rows.size(0), c.hidden}, res.tokens.dtype(), res.tokens.device());
    cuda::gather_rows(res.tokens, res.expert_rows, rows, cuda::current_stream());
    out.tokens = down(rows);
  } else {
    out.tokens = down(res.tokens);
  }
  out.probs = down(res.token_probs);
  out.tokens_per_expert = down(res.tokens_per_expert);
  out.dropped = dropped(res);
  // Expert-major rows: the table's when the rows stayed in place.
  const std::int64_t N = in_place ? res.expert_rows.size(0) : res.tokens.size(0), T = in.hidden.size(0), H = c.hidden;
  // Expert outputs and gradients: random everywhere, padding rows included (they must be ignored);
  // the expert outputs of wide range, so that the combine's order of additions is checked.
  const Tensor expert_out = wide_range_rows(N, H, 5, "expert_out", r);
  out.combined = down(d.combine(res.handle, up(expert_out)));
  const Tensor grad_out = random_tensor({T, H}, DType::bf16, 6, "grad_out", r);
  out.grad_expert_out = down(d.combine_backward(res.handle, up(grad_out)));
  const Tensor grad_tokens = random_tensor({N, H}, DType::bf16, 7, "grad_tokens", r);
  const Tensor grad_probs = random_tensor({N}, DType::f32, 8, "grad_probs", r);
  DispatchGrads g = d.dispatch_backward(res.handle, up(grad_tokens), up(grad_probs));
  out.grad_hidden = down(g.hidden);
  out.grad_weights = down(g.weights);
  return out;
}

inline std::vector<Outputs> run_host(const Config& c, int R, std::uint64_t seed = 1234) {
  auto world = std::make_shared<HostWorld>(R, 120.0);
  std::vector<Outputs> outs(static_cast<std::size_t>(R));
  const DispatchOptions o = dispatch_options(c, R);
  auto id = [](const Tensor& t) { return t; };
  auto dropped = [](const DispatchResult& r) { return r.dropped; };
  const auto errors = run_ranks(R, [&](int r) {
    auto d = make_host_dispatcher(world, r, c.experts_per_rank * R);
    outs[static_cast<std::size_t>(r)] = run_sequence(*d, make_inputs(c, R, r, seed), c, o, r, id, id, dropped);
  });
  EXPECT_TRUE(all_ok(errors)) << c.name << " (host backend)";
  return outs;
}

inline void expect_equal(const std::vector<Outputs>& want, const std::vector<Outputs>& got, const std::string& name) {
  for (std::size_t r = 0; r < want.size(); ++r) {
    SCOPED_TRACE(name + ", rank " + std::to_string(r));
    const Outputs& w = want[r];
    const Outputs& g = got[r];
    ASSERT_TRUE(g.tokens.defined()) << "no GPU result";
    EXPECT_TRUE(same_bytes(w.tokens, g.tokens)) << "tokens";
    EXPECT_TRUE(same_bytes(w.probs, g.probs)) << "token_probs";
    EXPECT_TRUE(same_bytes(w.tokens_per_expert, g.tokens_per_expert)) << "tokens_per_expert";
    EXPECT_EQ(w.dropped, g.dropped) << "dropped";
    EXPECT_TRUE(same_bytes(w.combined, g.combined)) << "combine";
    EXPECT_TRUE(same_bytes(w.grad_expert_out, g.grad_expert_out)) << "combine_backward";
    EXPECT_TRUE(same_bytes(w.grad_hidden, g.grad_hidden)) << "dispatch_backward hidden";
    EXPECT_TRUE(same_bytes(w.grad_weights, g.grad_weights)) << "dispatch_backward weights";
  }
}

inline CommunicatorOptions test_comm_options() {
  CommunicatorOptions co;
  co.timeout_seconds = 60;  // a failing rank must not leave the others waiting 300 s per call
  return co;
}

// Every config on the host backend, then on the GPUs (one communicator per GPU for all configs),
// then compared. run_rank(g, config) runs one config on GPU rank g with the backend under test.
// `outputs` (when given) gets the GPU's, [config][rank], for checks of the test's own.
inline void check_against_host(const std::vector<Config>& configs,
                               const std::function<Outputs(GpuRank&, const Config&)>& run_rank,
                               std::vector<std::vector<Outputs>>* outputs = nullptr) {
  const int R = gpu_ranks();
  std::vector<std::vector<Outputs>> want;
  for (const Config& c : configs) want.push_back(run_host(c, R));
  std::vector<std::vector<Outputs>> got(configs.size(), std::vector<Outputs>(static_cast<std::size_t>(R)));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        for (std::size_t i = 0; i < configs.size(); ++i)
          got[i][static_cast<std::size_t>(g.rank)] = run_rank(g, configs[i]);
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  for (std::size_t i = 0; i < configs.size(); ++i) expect_equal(want[i], got[i], configs[i].name);
  if (outputs) *outputs = std::move(got);
}

// ---- errors raised on every rank ---------------------------------------------------------------------

struct DeviceInputs {
  Tensor hidden, indices, weights;
  DispatchInput view() const {
    DispatchInput di;
    di.hidden = hidden;
    di.indices = indices;
    di.weights = weights;
    return di;
  }
};

// The top-k form of `in` on rank g's GPU.
inline DeviceInputs to_device(const Inputs& in, GpuRank& g) {
  return DeviceInputs{cuda::to_device(in.hidden, g.device, g.stream), cuda::to_device(in.indices, g.device, g.stream),
                      cuda::to_device(in.weights, g.device, g.stream)};
}

inline DeviceInputs device_inputs(GpuRank& g, int E, std::int64_t T, std::int64_t H, int k) {
  TopK tk = synthetic_topk(T, k, E, RoutingSpec{}, 3, g.rank);
  DeviceInputs in;
  in.hidden = cuda::to_device(random_tensor({T, H}, DType::bf16, 1, "hidden", g.rank), g.device, g.stream);
  in.indices = cuda::to_device(tk.indices, g.device, g.stream);
  in.weights = cuda::to_device(tk.weights, g.device, g.stream);
  return in;
}

// Runs `call`, keeping what it raised in `into` (null when nothing).
template <class Call>
void attempt(std::exception_ptr& into, Call&& call) {
  try {
    call();
  } catch (...) {
    into = std::current_exception();
  }
}

template <class Check>
auto argument_is(std::string argument, Check check) {
  return [argument, check](const ArgumentError& e) { return e.argument() == argument && check(std::string(e.what())); };
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Every rank but `missing` raised a TimeoutError naming `phase` and `missing` (a peer that never came).
inline void expect_timeouts(const std::vector<std::exception_ptr>& failures, int missing, const std::string& phase) {
  for (std::size_t r = 0; r < failures.size(); ++r) {
    if (static_cast<int>(r) == missing) continue;
    const std::exception_ptr& e = failures[r];
    ASSERT_TRUE(e != nullptr) << "rank " << r << ": no error";
    try {
      std::rethrow_exception(e);
    } catch (const TimeoutError& t) {
      EXPECT_EQ(t.phase(), phase) << t.what();
      EXPECT_EQ(t.peer(), missing) << t.what();
    } catch (...) {
      ADD_FAILURE() << "rank " << r << ": not a TimeoutError: " << what_of(e);
    }
  }
}

// Random e4m3 bytes [T, H] and scales [T, H / 128] of rank r, for the FP8 dispatches (every byte
// pattern: rows are moved, not read).
struct Fp8Rows {
  Tensor bytes, scales;
};
inline Fp8Rows fp8_rows(std::int64_t T, std::int64_t H, int r) {
  Fp8Rows f;
  f.bytes = Tensor::empty({T, H}, DType::e4m3);
  auto* b = static_cast<std::uint8_t*>(f.bytes.raw());
  for (std::int64_t i = 0; i < T * H; ++i) b[i] = static_cast<std::uint8_t>(splitmix64(i * 31 + r) & 0xff);
  f.scales = random_tensor({T, H / 128}, DType::f32, 77, "scales", r);
  return f;
}

}  // namespace flexep::testing
