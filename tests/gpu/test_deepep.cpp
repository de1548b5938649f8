// The deepep backend (DeepEP's rank-major layout) against the host backend's rank-major layout on the
// same inputs, bit for bit: recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, expert_rows,
// combine, combine_backward and dispatch_backward (hidden and weights); and its expert-major layout
// against the host's expert-major one (dispatch_harness.h's sequence). Configurations: uniform,
// Zipf and all tokens to one expert; ranks with T = 0; k from 1 to 8; pad multiples; H from 8 to
// 7168; int32 ids. Also run-to-run determinism, errors raised on every rank, and a missing peer
// turning into a TimeoutError that names the phase and the rank.
//
// OneRankPerGpu/DeepEpMultiGpu.<Test>/gpus: one rank per GPU (label multigpu);
// SimulatedRanks/DeepEpMultiGpu.<Test>/2ranks: two ranks sharing GPU 0 (label gpu).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include "flexep/core/rank_major.h"
#include "flexep/cuda/graph.h"
#include "flexep/dispatch/deepep.h"
#include "flexep/dispatch/host.h"
#include "gpu/dispatch_harness.h"
#include "gpu/gpu_test_util.h"
#include "gpu/multi_gpu.h"
#include "gpu/rank_variants.h"

namespace flexep::testing {
namespace {

class DeepEpMultiGpu : public RankVariantTest {};

INSTANTIATE_TEST_SUITE_P(OneRankPerGpu, DeepEpMultiGpu, ::testing::Values(Variant{0}), variant_name);
INSTANTIATE_TEST_SUITE_P(SimulatedRanks, DeepEpMultiGpu, ::testing::Values(Variant{2}), variant_name);

bool require_ranks() { return require_gpus(gpus_for_ranks(2)); }

// Rank-major rows the busiest receiver gets from make_inputs(c, R, .).
std::int64_t most_rank_major_rows(const Config& c, int R) {
  PlanParams p;
  p.ranks = R;
  p.experts = c.experts_per_rank * R;
  std::vector<std::int64_t> to(static_cast<std::size_t>(R), 0);
  for (int s = 0; s < R; ++s) {
    const std::vector<std::int64_t> rows = rank_major_row_counts(make_inputs(c, R, s).indices, p);
    for (int d = 0; d < R; ++d) to[static_cast<std::size_t>(d)] += rows[static_cast<std::size_t>(d)];
  }
  return *std::max_element(to.begin(), to.end());
}

// The rank-major options of c: blocking, or budget mode with budget_fraction of the busiest
// receiver's rows (rounded up to the pad multiple at or above 1, down below it).
DispatchOptions rank_major(const Config& c, int R) {
  DispatchOptions o;
  o.layout = DispatchLayout::rank_major;
  o.pad_multiple = c.pad;
  o.overflow = c.overflow;
  if (c.mode == DispatchMode::budget) {
    o.mode = DispatchMode::budget;
    const auto b = static_cast<std::int64_t>(static_cast<double>(most_rank_major_rows(c, R)) * c.budget_fraction);
    o.budget_rows = c.budget_fraction >= 1 ? (b + c.pad - 1) / c.pad * c.pad : b / c.pad * c.pad;
  }
  return o;
}

struct RankMajorOutputs {
  std::int64_t dropped = 0;
  Tensor recv_x, idx, weights, tpe, expert_rows;
  Tensor combined, grad_rows, grad_hidden, grad_weights;
};

template <class Up, class Down>
RankMajorOutputs run_sequence(TokenDispatcher& d, const Inputs& in, const Config& c, int R, int r, Up up, Down down) {
  const Tensor hidden = up(in.hidden), indices = up(in.indices), weights = up(in.weights);
  DispatchInput di;
  di.hidden = hidden;
  di.indices = indices;
  di.weights = weights;
  DispatchResult res = d.dispatch(di, rank_major(c, R));
  RankMajorOutputs out;
  out.dropped = res.dropped;
  out.recv_x = down(res.tokens);
  out.idx = down(res.topk_indices);
  out.weights = down(res.topk_weights);
  out.tpe = down(res.tokens_per_expert);
  out.expert_rows = down(res.expert_rows);
  const std::int64_t N = res.tokens.size(0), T = in.hidden.size(0), H = c.hidden, k = c.k;
  out.combined = down(d.combine(res.handle, up(wide_range_rows(N, H, 5, "expert_out", r))));
  out.grad_rows = down(d.combine_backward(res.handle, up(random_tensor({T, H}, DType::bf16, 6, "grad_out", r))));
  DispatchGrads g = d.dispatch_backward(res.handle, up(random_tensor({N, H}, DType::bf16, 7, "grad_tokens", r)),
                                        up(random_tensor({N, k}, DType::f32, 8, "grad_w", r)));
  out.grad_hidden = down(g.hidden);
  out.grad_weights = down(g.weights);
  return out;
}

std::vector<RankMajorOutputs> run_host_rank_major(const Config& c, int R) {
  auto world = std::make_shared<HostWorld>(R, 120.0);
  std::vector<RankMajorOutputs> outs(static_cast<std::size_t>(R));
  auto id = [](const Tensor& t) { return t; };
  EXPECT_TRUE(all_ok(run_ranks(R, [&](int r) {
    auto d = make_host_dispatcher(world, r, c.experts_per_rank * R);
    outs[static_cast<std::size_t>(r)] = run_sequence(*d, make_inputs(c, R, r), c, R, r, id, id);
  })));
  return outs;
}

DeepEpOptions options_for(const Config& c, int ranks) {
  DeepEpOptions o;
  o.hidden = c.hidden;
  std::int64_t most = 1;
  for (std::int64_t t : c.tokens) most = std::max(most, t);
  o.max_tokens_per_rank = most;
  o.max_topk = std::min(8, c.experts_per_rank * ranks);
  o.timeout_seconds = 20;
  if (c.mode == DispatchMode::budget)  // the budget may exceed the default window of R * T_max rows
    o.max_recv_rows = std::max(ranks * most, rank_major(c, ranks).budget_rows);
  return o;
}

RankMajorOutputs run_deepep(GpuRank& g, const Config& c) {
  auto d = make_deepep_dispatcher(g.comm, c.experts_per_rank * g.size, options_for(c, g.size));
  auto up = [&](const Tensor& t) { return cuda::to_device(t, g.device, g.stream); };
  auto down = [&](const Tensor& t) { return t.device().is_cpu() ? t : cuda::to_host(t, g.stream); };
  RankMajorOutputs out = run_sequence(*d, make_inputs(c, g.size, g.rank), c, g.size, g.rank, up, down);
  d->check_errors();  // budget mode raises device errors only here
  if (c.mode == DispatchMode::budget) out.dropped = d->last_dropped();  // on the device until asked
  return out;
}

void expect_equal(const std::vector<RankMajorOutputs>& want, const std::vector<RankMajorOutputs>& got,
                  const std::string& name) {
  for (std::size_t r = 0; r < want.size(); ++r) {
    SCOPED_TRACE(name + ", rank " + std::to_string(r));
    const RankMajorOutputs &w = want[r], &g = got[r];
    ASSERT_TRUE(g.recv_x.defined()) << "no GPU result";
    EXPECT_EQ(w.dropped, g.dropped) << "dropped";
    EXPECT_TRUE(same_bytes(w.recv_x, g.recv_x)) << "recv_x";
    EXPECT_TRUE(same_bytes(w.idx, g.idx)) << "recv_topk_idx";
    EXPECT_TRUE(same_bytes(w.weights, g.weights)) << "recv_topk_weights";
    EXPECT_TRUE(same_bytes(w.tpe, g.tpe)) << "tokens_per_expert";
    EXPECT_TRUE(same_bytes(w.expert_rows, g.expert_rows)) << "expert_rows";
    EXPECT_TRUE(same_bytes(w.combined, g.combined)) << "combine";
    EXPECT_TRUE(same_bytes(w.grad_rows, g.grad_rows)) << "combine_backward";
    EXPECT_TRUE(same_bytes(w.grad_hidden, g.grad_hidden)) << "dispatch_backward hidden";
    EXPECT_TRUE(same_bytes(w.grad_weights, g.grad_weights)) << "dispatch_backward weights";
  }
}

// The options of the error tests' small calls: H, at most T tokens, top-2, a 20 s deadline.
DeepEpOptions small_options(std::int64_t H, std::int64_t T, cudaStream_t stream) {
  DeepEpOptions o;
  o.hidden = H;
  o.max_tokens_per_rank = T;
  o.max_topk = 2;
  o.timeout_seconds = 20;
  o.stream = stream;
  return o;
}

void check_configs(const std::vector<Config>& configs, int R = gpu_ranks()) {
  std::vector<std::vector<RankMajorOutputs>> want;
  for (const Config& c : configs) want.push_back(run_host_rank_major(c, R));
  std::vector<std::vector<RankMajorOutputs>> got(configs.size(), std::vector<RankMajorOutputs>(R));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        for (std::size_t i = 0; i < configs.size(); ++i) got[i][static_cast<std::size_t>(g.rank)] = run_deepep(g, configs[i]);
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  for (std::size_t i = 0; i < configs.size(); ++i) expect_equal(want[i], got[i], configs[i].name);
}

std::vector<std::int64_t> tokens_for(int R, std::vector<std::int64_t> pattern) {
  std::vector<std::int64_t> t;
  for (int r = 0; r < R; ++r) t.push_back(pattern[static_cast<std::size_t>(r) % pattern.size()]);
  return t;
}

}  // namespace

TEST_P(DeepEpMultiGpu, MatchesHostUniformZipfAndOneExpert) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  std::vector<Config> configs = {
      config("uniform k2 H64", 2, 2, 64, tokens_for(R, {40, 23}), RoutingKind::uniform, 1),
      config("zipf k4 H128 pad4", 4, 4, 128, tokens_for(R, {64, 17}), RoutingKind::zipf, 4),
      config("hot k1 H8", 2, 1, 8, tokens_for(R, {31, 9}), RoutingKind::hot, 1),
      config("uniform k8 H256 T0", 4, 8, 256, tokens_for(R, {0, 50}), RoutingKind::uniform, 2),
      config("uniform k8 H7168", 8, 8, 7168, tokens_for(R, {12, 5}), RoutingKind::uniform, 1),
  };
  configs[2].routing.hot_expert = 1;
  configs.push_back(config("zipf k3 H64 i32", 3, 3, 64, tokens_for(R, {33, 40}), RoutingKind::zipf, 1));
  configs.back().i32_indices = true;
  check_configs(configs);
}

Outputs run_deepep_expert_major(GpuRank& g, const Config& c) {
  auto d = make_deepep_dispatcher(g.comm, c.experts_per_rank * g.size, options_for(c, g.size));
  auto up = [&](const Tensor& t) { return cuda::to_device(t, g.device, g.stream); };
  auto down = [&](const Tensor& t) { return t.device().is_cpu() ? t : cuda::to_host(t, g.stream); };
  auto dropped = [&](const DispatchResult& r) {  // budget mode: on the device until asked
    return c.mode == DispatchMode::budget ? d->last_dropped() : r.dropped;
  };
  Outputs out =
      run_sequence(*d, make_inputs(c, g.size, g.rank), c, dispatch_options(c, g.size), g.rank, up, down, dropped);
  d->check_errors();  // budget mode raises device errors only here
  return out;
}

// The expert-major layout: the rank-major rows gathered into the experts' lists on the receiver,
// and level 1 of the combine summed there before the rows travel back.
TEST_P(DeepEpMultiGpu, ExpertMajorMatchesHost) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  std::vector<Config> configs = {
      config("expert-major uniform k2 H64", 2, 2, 64, tokens_for(R, {40, 23})),
      config("expert-major zipf k8 H7168 pad 16", 8, 8, 7168, tokens_for(R, {200, 0}), RoutingKind::zipf, 16),
      config("expert-major hot k1 H8", 2, 1, 8, tokens_for(R, {31, 9}), RoutingKind::hot),
      config("expert-major uniform k4 H256 pad 128", 4, 4, 256, tokens_for(R, {0, 77}), RoutingKind::uniform, 128),
      config("no tokens anywhere", 2, 2, 8, tokens_for(R, {0})),
  };
  configs.push_back(config("expert-major zipf k3 H64 i32", 3, 3, 64, tokens_for(R, {33, 40}), RoutingKind::zipf));
  configs.back().i32_indices = true;
  check_against_host(configs, run_deepep_expert_major);
}

// rows_in_place on the expert-major layout (blocking mode, bf16): no expert-major copy; the received
// rank-major rows, copied out of the window, and the experts' table into them. Gathered through the
// table they are the host's expert-major rows, bit for bit, and combine and the backwards are
// unchanged; a token comes once per rank, so with k > 1 there are fewer rows than entries. Budget
// mode ignores the request (its listing is scratch that a later dispatch rewrites) and copies.
TEST_P(DeepEpMultiGpu, ExpertMajorRowsInPlaceMatchHost) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  std::vector<Config> configs = {
      config("in place uniform k2 H64", 2, 2, 64, tokens_for(R, {40, 23})),
      config("in place zipf k8 H7168 pad 16", 8, 8, 7168, tokens_for(R, {200, 0}), RoutingKind::zipf, 16),
      config("in place hot k1 H8", 2, 1, 8, tokens_for(R, {31, 9}), RoutingKind::hot),
      config("in place no tokens anywhere", 2, 2, 8, tokens_for(R, {0})),
      config("in place asked in budget mode", 2, 2, 64, tokens_for(R, {40, 23})),
  };
  configs.back().mode = DispatchMode::budget;
  for (Config& c : configs) c.rows_in_place = true;
  std::vector<std::vector<Outputs>> got;
  check_against_host(configs, run_deepep_expert_major, &got);
  ASSERT_EQ(got.size(), configs.size()) << "the GPU ranks failed";
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const bool budget = configs[i].mode == DispatchMode::budget;
    for (int r = 0; r < R; ++r) {
      const Outputs& o = got[i][static_cast<std::size_t>(r)];
      SCOPED_TRACE(configs[i].name + ", rank " + std::to_string(r));
      if (budget) {
        EXPECT_EQ(o.source_rows, -1) << "budget mode must copy";
        continue;
      }
      ASSERT_GE(o.source_rows, 0) << "the rows were copied, not left in place";
      if (configs[i].k > 1 && o.tokens.size(0) > 0) {
        EXPECT_LT(o.source_rows, o.tokens.size(0));
      }
    }
  }
}

// The expert-major layout in budget mode: every rank-major row received, the budget counting
// expert-major entries as the host's plan does (the tail -1 / zero, prob 0); with the drop policy a
// prefix of each receiver's entries is kept and the dropped pairs are the host's (last_dropped).
TEST_P(DeepEpMultiGpu, ExpertMajorBudgetModeMatchesHost) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  std::vector<Config> configs = {
      config("expert-major budget exact uniform k2 H64", 2, 2, 64, tokens_for(R, {40, 23})),
      config("expert-major budget roomy zipf k8 H7168 pad 16", 8, 8, 7168, tokens_for(R, {120, 0}), RoutingKind::zipf,
             16),
      config("expert-major budget exact hot k1 H8", 2, 1, 8, tokens_for(R, {31, 9}), RoutingKind::hot),
      config("expert-major budget drop uniform k4 H256 pad 4", 4, 4, 256, tokens_for(R, {60, 45}),
             RoutingKind::uniform, 4),
      config("expert-major budget drop zipf k8 H7168 T0", 8, 8, 7168, tokens_for(R, {0, 90}), RoutingKind::zipf),
      config("expert-major budget drop hot k2 H128 pad 8", 2, 2, 128, tokens_for(R, {40, 40}), RoutingKind::hot, 8),
      // Half of 2 rows rounded down to the pad: a budget of 0 entries, every pair dropped; the
      // received rows still get their (zero) weight gradients back.
      config("expert-major budget drop to no entries hot k1 H64 pad 2", 4, 1, 64, tokens_for(R, {0, 2}),
             RoutingKind::hot, 2),
  };
  for (std::size_t i = 0; i < configs.size(); ++i) {
    configs[i].mode = DispatchMode::budget;
    configs[i].budget_fraction = i < 3 ? (i % 2 ? 1.5 : 1.0) : 0.5;
    if (i >= 3) configs[i].overflow = OverflowPolicy::drop;
  }
  check_against_host(configs, run_deepep_expert_major);
}

TEST_P(DeepEpMultiGpu, RepeatedCallsGiveTheSameBits) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  const Config c = config("zipf k4 H128", 4, 4, 128, tokens_for(R, {96, 80}), RoutingKind::zipf, 2);
  std::vector<std::vector<RankMajorOutputs>> runs(3, std::vector<RankMajorOutputs>(R));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_deepep_dispatcher(g.comm, c.experts_per_rank * g.size, options_for(c, g.size));
        auto up = [&](const Tensor& t) { return cuda::to_device(t, g.device, g.stream); };
        auto down = [&](const Tensor& t) { return t.device().is_cpu() ? t : cuda::to_host(t, g.stream); };
        for (int i = 0; i < 3; ++i)  // one dispatcher: the epochs grow, the windows are reused
          runs[i][static_cast<std::size_t>(g.rank)] =
              run_sequence(*d, make_inputs(c, g.size, g.rank), c, g.size, g.rank, up, down);
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  const auto want = run_host_rank_major(c, R);
  for (int i = 0; i < 3; ++i) expect_equal(want, runs[i], "call " + std::to_string(i));
}

// The buffers' life cycle: memory() as size_hint says at creation and after a resize; release()
// frees everything, a handle from before it is stale, the next dispatch allocates again; resize()
// to larger options, and one refused on every rank when a rank sizes its buffers differently (the
// old buffers stay); set_num_sms checked by name. Every call's results are the host backend's.
TEST_P(DeepEpMultiGpu, MemoryResizeReleaseAndStaleHandles) {
  if (!require_ranks()) return;
  const int R = gpu_ranks(), E = 2 * R;
  const Config small = config("small", 2, 2, 64, tokens_for(R, {40, 23}));
  const Config big = config("big", 2, 2, 128, tokens_for(R, {120, 7}), RoutingKind::zipf, 2);
  const std::vector<RankMajorOutputs> want_small = run_host_rank_major(small, R), want_big = run_host_rank_major(big, R);
  std::vector<RankMajorOutputs> got_small(static_cast<std::size_t>(R)), got_big(got_small), got_after(got_small);
  std::vector<std::exception_ptr> released(static_cast<std::size_t>(R)), stale(released), mismatch(released),
      bad_sms(released);
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        const auto r = static_cast<std::size_t>(g.rank);
        auto up = [&](const Tensor& t) { return cuda::to_device(t, g.device, g.stream); };
        auto down = [&](const Tensor& t) { return t.device().is_cpu() ? t : cuda::to_host(t, g.stream); };
        const DeepEpOptions o = options_for(small, g.size);
        auto d = make_deepep_dispatcher(g.comm, E, o);
        const DeepEpMemory m = d->memory(), hint = DeepEpDispatcher::size_hint(o, g.size, E);
        EXPECT_EQ(m.window, hint.window);
        EXPECT_EQ(m.flags, hint.flags);
        EXPECT_EQ(m.local, hint.local);
        // The window holds recv_x, combine_backward's rows and the rows coming back, each R x T x H bf16.
        EXPECT_GE(m.window, 3u * static_cast<std::size_t>(R) * 40 * 64 * 2);

        const Inputs in = make_inputs(small, g.size, g.rank);
        const Tensor x = up(in.hidden), idx = up(in.indices), w = up(in.weights);
        DispatchInput di;
        di.hidden = x;
        di.indices = idx;
        di.weights = w;
        const DispatchResult before = d->dispatch(di, rank_major(small, g.size));
        const Tensor rows = Tensor::zeros({before.tokens.size(0), 64}, DType::bf16, Device::cuda(g.device));
        d->release();
        EXPECT_EQ(d->memory().total(), 0u);
        try {
          d->combine(before.handle, rows);
        } catch (...) {
          released[r] = std::current_exception();
        }
        got_small[r] = run_sequence(*d, in, small, g.size, g.rank, up, down);  // allocates again
        EXPECT_EQ(d->memory().total(), hint.total());
        try {
          d->combine(before.handle, rows);  // every rank: each raises, after stopping together
        } catch (...) {
          stale[r] = std::current_exception();
        }

        const DeepEpOptions ob = options_for(big, g.size);
        d->resize(ob);
        EXPECT_EQ(d->memory().total(), DeepEpDispatcher::size_hint(ob, g.size, E).total());
        EXPECT_GT(d->memory().window, m.window);
        got_big[r] = run_sequence(*d, make_inputs(big, g.size, g.rank), big, g.size, g.rank, up, down);
        DeepEpOptions odd = ob;
        if (g.rank == 1) odd.hidden = 256;
        try {
          d->resize(odd);
        } catch (...) {
          mismatch[r] = std::current_exception();
        }
        EXPECT_EQ(d->options().hidden, 128);
        try {
          d->set_num_sms(5000);
        } catch (...) {
          bad_sms[r] = std::current_exception();
        }
        d->set_num_sms(3);
        EXPECT_EQ(d->num_sms(), 3);
        got_after[r] = run_sequence(*d, make_inputs(big, g.size, g.rank), big, g.size, g.rank, up, down);
        d->check_errors();
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  expect_equal(want_small, got_small, "small, after release");
  expect_equal(want_big, got_big, "big, after resize");
  expect_equal(want_big, got_after, "big, 3 SMs, after a refused resize");
  EXPECT_TRUE(all_threw<ArgumentError>(released, argument_is("handle", [](const std::string& m) {
    return contains(m, "released after its dispatch");
  })));
  EXPECT_TRUE(all_threw<ArgumentError>(stale, argument_is("handle", [](const std::string& m) {
    return contains(m, "stale") || contains(m, "failed its checks");
  })));
  EXPECT_TRUE(all_threw<ArgumentError>(mismatch, argument_is("options.hidden", [](const std::string& m) {
    return contains(m, "rank 1 has hidden=256 but rank 0 has 128");
  })));
  EXPECT_TRUE(all_threw<ArgumentError>(bad_sms, argument_is("sms", [](const std::string& m) {
    return contains(m, "5000 is outside [0, 1024]");
  })));
}

// Budget mode: the counts cross on the device; recv_x has budget rows (the tail zero, slots -1),
// tokens_per_expert stays on the device, expert_rows has its capacity (the tail -1); with the drop
// policy the kept rows and the dropped pairs (last_dropped) are the host's.
TEST_P(DeepEpMultiGpu, BudgetModeMatchesHost) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  std::vector<Config> configs = {
      config("budget exact uniform k2 H64", 2, 2, 64, tokens_for(R, {40, 23})),
      config("budget roomy zipf k4 H128 pad4", 4, 4, 128, tokens_for(R, {64, 17}), RoutingKind::zipf, 4),
      config("budget exact uniform k8 H7168 T0", 8, 8, 7168, tokens_for(R, {0, 50})),
      config("budget roomy hot k1 H8", 2, 1, 8, tokens_for(R, {31, 9}), RoutingKind::hot),
  };
  for (std::size_t i = 0; i < configs.size(); ++i) {
    configs[i].mode = DispatchMode::budget;
    configs[i].budget_fraction = i % 2 ? 1.5 : 1.0;
  }
  // The drop policy: each receiver keeps the first rows of the (source, token) order.
  for (Config c : {config("budget drop uniform k4 H64", 4, 4, 64, tokens_for(R, {60, 45})),
                   config("budget drop zipf k8 H7168 pad4 T0", 8, 8, 7168, tokens_for(R, {0, 90}), RoutingKind::zipf, 4),
                   config("budget drop hot k2 H128", 2, 2, 128, tokens_for(R, {40, 40}), RoutingKind::hot)}) {
    c.mode = DispatchMode::budget;
    c.overflow = OverflowPolicy::drop;
    c.budget_fraction = 0.6;
    configs.push_back(c);
  }
  check_configs(configs);
}

// A budget call's errors surface at the next check, on every rank, as blocking mode raises them;
// the dispatcher stays usable.
TEST_P(DeepEpMultiGpu, BudgetErrorsAreRaisedOnEveryRankAtTheNextCheck) {
  if (!require_ranks()) return;
  const int R = gpu_ranks(), E = 2 * R;
  std::vector<std::exception_ptr> overflow(static_cast<std::size_t>(R)), entries_overflow(overflow), bad_id(overflow),
      stale(overflow);
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        DeepEpOptions o;
        o.hidden = 8;
        o.max_tokens_per_rank = 16;
        o.max_topk = 2;
        o.timeout_seconds = 20;
        auto d = make_deepep_dispatcher(g.comm, E, o);
        const std::size_t r = static_cast<std::size_t>(g.rank);
        DispatchOptions b;
        b.layout = DispatchLayout::rank_major;
        b.mode = DispatchMode::budget;
        b.budget_rows = 4;  // every rank receives more than 4 of the 16 R tokens' rows
        DeviceInputs in = device_inputs(g, E, 16, 8, 2);
        d->dispatch(in.view(), b);  // returns: nothing waits
        try {
          d->check_errors();
        } catch (...) {
          overflow[r] = std::current_exception();
        }
        DispatchOptions em = b;  // the expert-major budget counts entries: 16 R tokens x top-2 need more than 8
        em.layout = DispatchLayout::expert_major;
        em.budget_rows = 8;
        d->dispatch(device_inputs(g, E, 16, 8, 2).view(), em);
        try {
          d->check_errors();
        } catch (...) {
          entries_overflow[r] = std::current_exception();
        }
        b.budget_rows = 16 * R;
        TopK tk = synthetic_topk(16, 2, E, RoutingSpec{}, 3, g.rank);
        if (g.rank == g.size - 1) tk.indices.data<std::int64_t>()[5 * 2] = E + 3;  // the last rank's token 5
        in.indices = cuda::to_device(tk.indices, g.device, g.stream);
        d->dispatch(in.view(), b);
        try {
          d->check_errors();
        } catch (...) {
          bad_id[r] = std::current_exception();
        }
        try {
          d->check_errors();  // raised once
        } catch (...) {
          stale[r] = std::current_exception();
        }
        DispatchOptions rm;
        rm.layout = DispatchLayout::rank_major;
        DispatchResult ok = d->dispatch(device_inputs(g, E, 16, 8, 2).view(), rm);  // still usable
        d->combine(ok.handle, ok.tokens);
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  for (int r = 0; r < R; ++r) {
    EXPECT_TRUE(contains(what_of(overflow[static_cast<std::size_t>(r)]), "dispatch overflow: rank"))
        << what_of(overflow[static_cast<std::size_t>(r)]);
    EXPECT_TRUE(contains(what_of(entries_overflow[static_cast<std::size_t>(r)]), "expert-major rows"))
        << what_of(entries_overflow[static_cast<std::size_t>(r)]);
    EXPECT_TRUE(stale[static_cast<std::size_t>(r)] == nullptr) << what_of(stale[static_cast<std::size_t>(r)]);
  }
  EXPECT_TRUE(all_threw<ArgumentError>(bad_id, argument_is("indices", [](const std::string&) { return true; })));
}

// A budget-mode dispatch and its combine captured once, replayed with new inputs, in both layouts:
// no host sync inside, the results of every replay those of the host backend. The expert-major
// layout's outputs are the dispatcher's own buffers, sized by an uncaptured call first; a capture
// that would need them larger is refused by name on every rank.
TEST_P(DeepEpMultiGpu, BudgetDispatchAndCombineReplayInACudaGraph) {
  if (!require_ranks()) return;
  const int R = gpu_ranks(), L = 4, E = L * R, k = 4;
  const std::int64_t T = 48, H = 64;
  const int replays = 3;
  Config c = config("graph", L, k, H, tokens_for(R, {T}));
  for (const DispatchLayout layout : {DispatchLayout::rank_major, DispatchLayout::expert_major}) {
    const bool expert_major = layout == DispatchLayout::expert_major;
    SCOPED_TRACE(expert_major ? "expert-major" : "rank-major");
    DispatchOptions o;
    o.layout = layout;
    o.mode = DispatchMode::budget;
    o.pad_multiple = 2;
    o.budget_rows = expert_major ? R * T * k + L * (o.pad_multiple - 1) : R * T;  // no routing exceeds it
    struct Want {
      Tensor recv_x, tpe, combined;
    };
    std::vector<std::vector<Want>> want(replays, std::vector<Want>(static_cast<std::size_t>(R)));
    for (int rep = 0; rep < replays; ++rep) {
      auto world = std::make_shared<HostWorld>(R, 60.0);
      Config cr = c;
      cr.routing.kind = rep % 2 ? RoutingKind::zipf : RoutingKind::uniform;
      ASSERT_TRUE(all_ok(run_ranks(R, [&](int r) {
        auto d = make_host_dispatcher(world, r, E);
        const Inputs in = make_inputs(cr, R, r, 700 + static_cast<std::uint64_t>(rep));
        DispatchInput di;
        di.hidden = in.hidden;
        di.indices = in.indices;
        di.weights = in.weights;
        DispatchResult res = d->dispatch(di, o);
        Want& w = want[static_cast<std::size_t>(rep)][static_cast<std::size_t>(r)];
        w.recv_x = res.tokens;
        w.tpe = res.tokens_per_expert;
        w.combined = d->combine(res.handle, res.tokens);
      })));
    }
    std::vector<std::exception_ptr> grown(static_cast<std::size_t>(R));
    const auto errors = run_gpu_ranks(
        R,
        [&](GpuRank& g) {
          DeepEpOptions opt;
          opt.hidden = H;
          opt.max_tokens_per_rank = T;
          opt.max_topk = k;
          opt.stream = g.stream;
          opt.timeout_seconds = 20;
          auto d = make_deepep_dispatcher(g.comm, E, opt);
          const Device dev = Device::cuda(g.device);
          const Inputs first = make_inputs(c, R, g.rank, 1);
          const Tensor x = cuda::to_device(first.hidden, g.device, g.stream);
          const Tensor idx = cuda::to_device(first.indices, g.device, g.stream);
          const Tensor w = cuda::to_device(first.weights, g.device, g.stream);
          const Tensor out = Tensor::empty({T, H}, DType::bf16, dev);
          DispatchInput di;
          di.hidden = x;
          di.indices = idx;
          di.weights = w;
          DispatchResult warm = d->dispatch(di, o);  // loads the kernels, sizes the buffers, outside the capture
          d->combine(warm.handle, warm.tokens);
          d->check_errors();
          DispatchResult res;
          {
            const cuda::CapturedGraph graph(g.stream, cudaStreamCaptureModeThreadLocal, [&] {
              res = d->dispatch(di, o);
              const Tensor y = d->combine(res.handle, res.tokens);
              FLEXEP_CUDA_CHECK(cudaMemcpyAsync(out.raw(), y.raw(), y.nbytes(), cudaMemcpyDeviceToDevice, g.stream));
            });
            Config cr = c;
            for (int rep = 0; rep < replays; ++rep) {
              SCOPED_TRACE("replay " + std::to_string(rep) + ", rank " + std::to_string(g.rank));
              cr.routing.kind = rep % 2 ? RoutingKind::zipf : RoutingKind::uniform;
              const Inputs in = make_inputs(cr, R, g.rank, 700 + static_cast<std::uint64_t>(rep));
              cuda::copy_async(x, in.hidden, g.stream);
              cuda::copy_async(idx, in.indices, g.stream);
              cuda::copy_async(w, in.weights, g.stream);
              if (simulated_ranks() > 0) {
                FLEXEP_CUDA_CHECK(cudaStreamSynchronize(g.stream));
                g.comm->barrier("graph replay");
              }
              graph.launch(g.stream);
              const Want& wr = want[static_cast<std::size_t>(rep)][static_cast<std::size_t>(g.rank)];
              EXPECT_TRUE(same_bytes(wr.recv_x, cuda::to_host(res.tokens, g.stream))) << "recv_x";
              EXPECT_TRUE(same_bytes(wr.tpe, cuda::to_host(res.tokens_per_expert, g.stream))) << "tokens_per_expert";
              EXPECT_TRUE(same_bytes(wr.combined, cuda::to_host(out, g.stream))) << "combine";
            }
            d->check_errors();
          }
          if (!expert_major) return;
          DispatchOptions larger = o;
          larger.budget_rows = 2 * o.budget_rows;
          try {
            const cuda::CapturedGraph refused(g.stream, cudaStreamCaptureModeThreadLocal,
                                              [&] { d->dispatch(di, larger); });
          } catch (...) {
            grown[static_cast<std::size_t>(g.rank)] = std::current_exception();
          }
          DispatchResult again = d->dispatch(di, larger);  // uncaptured, it grows them
          d->combine(again.handle, again.tokens);
          d->check_errors();
        },
        test_comm_options());
    ASSERT_TRUE(all_ok(errors));
    if (expert_major) {
      EXPECT_TRUE(all_threw<ArgumentError>(grown, argument_is("options.budget_rows", [](const std::string& m) {
        return contains(m, "CUDA graph capture");
      })));
    }
  }
}

// ---- FP8 dispatch ------------------------------------------------------------------------------------------

// dispatch_fp8 moves e4m3 rows and their scales exactly as bf16 rows move: the host backend, given
// the same bytes as bf16 containers ([T, H/2]) and the scales as f32 rows, places them in the same
// rows, in both layouts and in budget mode; the slots, lists and counts are the bf16 dispatch's, and
// the handle combines bf16 expert outputs as the bf16 dispatch's handle does.
TEST_P(DeepEpMultiGpu, Fp8DispatchMovesRowsAndScalesLikeBf16) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  struct Case {
    Config c;
    bool rank_major;
  };
  std::vector<Case> cases = {
      {config("fp8 rank-major uniform k8 H7168", 8, 8, 7168, tokens_for(R, {40, 0}), RoutingKind::uniform, 1), true},
      {config("fp8 rank-major zipf k4 H256 budget", 4, 4, 256, tokens_for(R, {64, 17}), RoutingKind::zipf, 4), true},
      {config("fp8 expert-major hot k2 H1024 pad 16", 4, 2, 1024, tokens_for(R, {31, 50}), RoutingKind::hot, 16),
       false},
  };
  cases[1].c.mode = DispatchMode::budget;
  cases[1].c.budget_fraction = 1.5;
  for (const Case& cs : cases) {
    const Config& c = cs.c;
    SCOPED_TRACE(c.name);
    const int E = c.experts_per_rank * R;
    const std::int64_t H = c.hidden;
    const DispatchOptions o = cs.rank_major ? rank_major(c, R) : dispatch_options(c, R);
    struct Want {
      Tensor rows, scales, idx, weights, probs, tpe, expert_rows, combined;
    };
    std::vector<Want> want(static_cast<std::size_t>(R));
    {
      auto world = std::make_shared<HostWorld>(R, 60.0);
      ASSERT_TRUE(all_ok(run_ranks(R, [&](int r) {
        auto d = make_host_dispatcher(world, r, E);
        const Inputs in = make_inputs(c, R, r);
        const Fp8Rows f = fp8_rows(in.hidden.size(0), H, r);
        DispatchOptions ho = o;
        ho.check_finite = false;  // random bytes viewed as bf16 may be NaN
        DispatchInput di;
        di.indices = in.indices;
        di.weights = in.weights;
        di.hidden = TensorView(f.bytes.raw(), DType::bf16, {in.hidden.size(0), H / 2});
        DispatchResult a = d->dispatch(di, ho);
        di.hidden = f.scales;
        DispatchResult b = d->dispatch(di, ho);
        di.hidden = in.hidden;
        DispatchResult res = d->dispatch(di, ho);
        Want& w = want[static_cast<std::size_t>(r)];
        w.rows = a.tokens;
        w.scales = b.tokens;
        w.idx = res.topk_indices;
        w.weights = res.topk_weights;
        w.probs = res.token_probs;
        w.tpe = res.tokens_per_expert;
        w.expert_rows = res.expert_rows;
        w.combined = d->combine(res.handle, wide_range_rows(res.tokens.size(0), H, 5, "expert_out", r));
      })));
    }
    const auto errors = run_gpu_ranks(
        R,
        [&](GpuRank& g) {
          DeepEpOptions opt = options_for(c, g.size);
          opt.stream = g.stream;
          auto d = make_deepep_dispatcher(g.comm, E, opt);
          const Inputs in = make_inputs(c, g.size, g.rank);
          const Fp8Rows f = fp8_rows(in.hidden.size(0), H, g.rank);
          const Tensor x = cuda::to_device(f.bytes, g.device, g.stream);
          const Tensor sc = cuda::to_device(f.scales, g.device, g.stream);
          const Tensor idx = cuda::to_device(in.indices, g.device, g.stream);
          const Tensor w = cuda::to_device(in.weights, g.device, g.stream);
          DispatchInput di;
          di.hidden = x;
          di.indices = idx;
          di.weights = w;
          Fp8DispatchResult res = d->dispatch_fp8(di, sc, o);
          const Want& want_r = want[static_cast<std::size_t>(g.rank)];
          auto down = [&](const Tensor& t) { return t.device().is_cpu() ? t : cuda::to_host(t, g.stream); };
          const Tensor rows = down(res.dispatch.tokens);
          EXPECT_EQ(rows.dtype(), DType::e4m3);
          ASSERT_EQ(rows.nbytes(), want_r.rows.nbytes());
          EXPECT_EQ(std::memcmp(rows.raw(), want_r.rows.raw(), static_cast<std::size_t>(rows.nbytes())), 0)
              << "e4m3 rows";
          EXPECT_TRUE(same_bytes(want_r.scales, down(res.scales))) << "scales";
          EXPECT_TRUE(same_bytes(want_r.tpe, down(res.dispatch.tokens_per_expert))) << "tokens_per_expert";
          if (cs.rank_major) {
            EXPECT_TRUE(same_bytes(want_r.idx, down(res.dispatch.topk_indices))) << "recv_topk_idx";
            EXPECT_TRUE(same_bytes(want_r.weights, down(res.dispatch.topk_weights))) << "recv_topk_weights";
            EXPECT_TRUE(same_bytes(want_r.expert_rows, down(res.dispatch.expert_rows))) << "expert_rows";
          } else {
            EXPECT_TRUE(same_bytes(want_r.probs, down(res.dispatch.token_probs))) << "token_probs";
          }
          const std::int64_t N = res.dispatch.tokens.size(0);
          const Tensor eo = cuda::to_device(wide_range_rows(N, H, 5, "expert_out", g.rank), g.device, g.stream);
          EXPECT_TRUE(same_bytes(want_r.combined, down(d->combine(res.dispatch.handle, eo))))
              << "combine after an FP8 dispatch";
          d->check_errors();
        },
        test_comm_options());
    ASSERT_TRUE(all_ok(errors));
  }
}

// FP8 rows on one rank and bf16 on the others: an ArgumentError naming `hidden` on every rank, in
// blocking and in budget mode (there at the next check); wrong scales are refused by name.
TEST_P(DeepEpMultiGpu, Fp8FormatMismatchAndBadScalesAreNamed) {
  if (!require_ranks()) return;
  const int R = gpu_ranks(), E = 2 * R;
  const std::int64_t T = 6, H = 256;
  std::vector<std::exception_ptr> blocking(static_cast<std::size_t>(R)), budget(blocking), scales(blocking);
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_deepep_dispatcher(g.comm, E, small_options(H, T, g.stream));
        const std::size_t r = static_cast<std::size_t>(g.rank);
        const Fp8Rows f = fp8_rows(T, H, g.rank);
        const Tensor x8 = cuda::to_device(f.bytes, g.device, g.stream);
        const Tensor sc = cuda::to_device(f.scales, g.device, g.stream);
        DeviceInputs in = device_inputs(g, E, T, H, 2);
        auto call = [&](const DispatchOptions& opt) {
          if (g.rank == 0) {
            DispatchInput di = in.view();
            di.hidden = x8;
            d->dispatch_fp8(di, sc, opt);
          } else {
            d->dispatch(in.view(), opt);
          }
        };
        DispatchOptions rm;
        rm.layout = DispatchLayout::rank_major;
        try {
          call(rm);
        } catch (...) {
          blocking[r] = std::current_exception();
        }
        DispatchOptions b = rm;
        b.mode = DispatchMode::budget;
        b.budget_rows = T * R;
        try {
          call(b);
          d->check_errors();
        } catch (...) {
          budget[r] = std::current_exception();
        }
        try {  // scales of the wrong width on every rank
          const Tensor bad = cuda::to_device(random_tensor({T, 3}, DType::f32, 1, "scales", g.rank), g.device, g.stream);
          DispatchInput di = in.view();
          di.hidden = x8;
          d->dispatch_fp8(di, bad, rm);
        } catch (...) {
          scales[r] = std::current_exception();
        }
        DispatchResult ok = d->dispatch(in.view(), rm);  // still usable
        d->combine(ok.handle, ok.tokens);
        d->check_errors();
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  auto format = [](const std::string& w) { return contains(w, "FP8 (dispatch_fp8) rows"); };
  EXPECT_TRUE(all_threw<ArgumentError>(blocking, argument_is("hidden", format)));
  EXPECT_TRUE(all_threw<ArgumentError>(budget, argument_is("hidden", format)));
  EXPECT_TRUE(all_threw<ArgumentError>(scales, argument_is("scales", [](const std::string&) { return true; })));
}

TEST_P(DeepEpMultiGpu, ErrorsAreRaisedOnEveryRank) {
  if (!require_ranks()) return;
  const int R = gpu_ranks(), E = 2 * R;
  std::vector<std::exception_ptr> bad_id(static_cast<std::size_t>(R)), layout(bad_id), too_many(bad_id);
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        DeepEpOptions o;
        o.hidden = 8;
        o.max_tokens_per_rank = 6;
        o.max_topk = 2;
        auto d = make_deepep_dispatcher(g.comm, E, o);
        const std::size_t r = static_cast<std::size_t>(g.rank);
        DispatchOptions rm;
        rm.layout = DispatchLayout::rank_major;
        try {  // the last rank routes token 2 to expert E
          TopK tk = synthetic_topk(6, 2, E, RoutingSpec{}, 3, g.rank);
          if (g.rank == g.size - 1) tk.indices.data<std::int64_t>()[2 * 2 + 1] = E;
          DeviceInputs in = device_inputs(g, E, 6, 8, 2);
          in.indices = cuda::to_device(tk.indices, g.device, g.stream);
          d->dispatch(in.view(), rm);
        } catch (...) {
          bad_id[r] = std::current_exception();
        }
        try {  // rank 0 asks for the expert-major layout, the others for the rank-major one
          DispatchOptions b = rm;
          if (g.rank == 0) b.layout = DispatchLayout::expert_major;
          d->dispatch(device_inputs(g, E, 6, 8, 2).view(), b);
        } catch (...) {
          layout[r] = std::current_exception();
        }
        try {  // rank 0 has more tokens than the buffers hold
          d->dispatch(device_inputs(g, E, g.rank == 0 ? 7 : 6, 8, 2).view(), rm);
        } catch (...) {
          too_many[r] = std::current_exception();
        }
        DispatchResult ok = d->dispatch(device_inputs(g, E, 6, 8, 2).view(), rm);  // still usable
        d->combine(ok.handle, ok.tokens);
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  EXPECT_TRUE(all_threw<ArgumentError>(bad_id, argument_is("indices", [](const std::string&) { return true; })));
  EXPECT_TRUE(all_threw<ArgumentError>(layout, argument_is("options.layout", [](const std::string& w) {
    return contains(w, "expert_major");
  })));
  EXPECT_TRUE(all_threw<ArgumentError>(too_many, argument_is("hidden", [](const std::string&) { return true; })));
  for (int r = 1; r < R; ++r)
    EXPECT_TRUE(contains(what_of(too_many[static_cast<std::size_t>(r)]), "rank 0 failed its checks"));
}

// An argument error found on one rank in combine or a backward reaches every rank as an
// ArgumentError naming that argument (the failing rank still takes part, sending nothing, and its
// peers' receive kernels see why); the dispatcher stays usable.
TEST_P(DeepEpMultiGpu, ErrorsInCombineAndBackwardsReachEveryRank) {
  if (!require_ranks()) return;
  const int R = gpu_ranks(), E = 2 * R;
  const std::int64_t T = 6, H = 8;
  std::vector<std::exception_ptr> combine(static_cast<std::size_t>(R)), grads(combine), rows(combine), handle(combine),
      expert_major(combine);
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_deepep_dispatcher(g.comm, E, small_options(H, T, g.stream));
        const std::size_t r = static_cast<std::size_t>(g.rank);
        const DeviceInputs in = device_inputs(g, E, T, H, 2);
        DispatchOptions rm;
        rm.layout = DispatchLayout::rank_major;
        const DispatchResult res = d->dispatch(in.view(), rm);
        const std::int64_t N = res.tokens.size(0);
        const Device dev = Device::cuda(g.device);
        const int last = g.size - 1;
        attempt(combine[r], [&] {  // the last rank's expert_out has one row too many
          const Tensor bad = Tensor::zeros({N + 1, H}, DType::bf16, dev);
          d->combine(res.handle, g.rank == last ? TensorView(bad) : TensorView(res.tokens));
        });
        attempt(grads[r], [&] {  // rank 0's weight gradients have a column too few
          const Tensor gw = Tensor::zeros({N, g.rank == 0 ? 1 : 2}, DType::f32, dev);
          d->dispatch_backward(res.handle, res.tokens, gw);
        });
        attempt(rows[r], [&] {  // the last rank's grad_out is bf16 of the wrong width
          const Tensor go = Tensor::zeros({T, g.rank == last ? H + 8 : H}, DType::bf16, dev);
          d->combine_backward(res.handle, go);
        });
        attempt(handle[r], [&] { d->combine(g.rank == 0 ? Handle() : res.handle, res.tokens); });
        attempt(expert_major[r], [&] {  // the expert-major layout's combine, the last rank's rows f32
          const DispatchResult em = d->dispatch(in.view(), DispatchOptions{});
          const Tensor bad = Tensor::zeros({em.tokens.size(0), H}, DType::f32, dev);
          d->combine(em.handle, g.rank == last ? TensorView(bad) : TensorView(em.tokens));
        });
        const Tensor ok = d->combine(res.handle, res.tokens);  // still usable, the same handle
        d->check_errors();
        EXPECT_EQ(ok.size(0), T);
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  const int last = R - 1;
  auto names = [](const char* arg) { return argument_is(arg, [](const std::string&) { return true; }); };
  EXPECT_TRUE(all_threw<ArgumentError>(combine, names("expert_out")));
  EXPECT_TRUE(all_threw<ArgumentError>(grads, names("grad_token_probs")));
  EXPECT_TRUE(all_threw<ArgumentError>(rows, names("grad_out")));
  EXPECT_TRUE(all_threw<ArgumentError>(handle, names("handle")));
  EXPECT_TRUE(all_threw<ArgumentError>(expert_major, names("expert_out")));
  for (int r = 0; r < R; ++r) {
    if (r != last) {
      EXPECT_TRUE(contains(what_of(combine[static_cast<std::size_t>(r)]),
                           "rank " + std::to_string(last) + " failed its checks in deepep combine:rows"))
          << what_of(combine[static_cast<std::size_t>(r)]);
    }
    if (r != 0) {
      EXPECT_TRUE(contains(what_of(grads[static_cast<std::size_t>(r)]),
                           "rank 0 failed its checks in deepep dispatch_backward:rows"))
          << what_of(grads[static_cast<std::size_t>(r)]);
    }
  }
}

namespace {

// What creating a dispatcher with options_of(rank) and experts_per_rank x R experts raised on
// every rank (null where nothing was raised).
std::vector<std::exception_ptr> creation_failures(int R, int experts_per_rank,
                                                  const std::function<DeepEpOptions(int)>& options_of) {
  std::vector<std::exception_ptr> failures(static_cast<std::size_t>(R));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        try {
          make_deepep_dispatcher(g.comm, experts_per_rank * g.size, options_of(g.rank));
        } catch (...) {
          failures[static_cast<std::size_t>(g.rank)] = std::current_exception();
        }
      },
      test_comm_options());
  EXPECT_TRUE(all_ok(errors));
  return failures;
}

}  // namespace

TEST_P(DeepEpMultiGpu, BadOptionsOnOneRankStopEveryRank) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  const std::vector<std::exception_ptr> failures = creation_failures(R, 2, [](int rank) {
    DeepEpOptions o;
    o.hidden = rank == 0 ? 7 : 8;
    o.max_tokens_per_rank = 4;
    return o;
  });
  ASSERT_TRUE(failures[0] != nullptr);
  EXPECT_TRUE(contains(what_of(failures[0]), "'options.hidden'")) << what_of(failures[0]);
  for (int r = 1; r < R; ++r)
    EXPECT_TRUE(contains(what_of(failures[static_cast<std::size_t>(r)]), "rank 0 rejected its deepep options"))
        << what_of(failures[static_cast<std::size_t>(r)]);
}

// Buffers larger than the GPU (10^8 tokens per rank at H 7168: terabytes of window) are refused
// before anything is allocated, on every rank, naming the options and the bytes they need.
TEST_P(DeepEpMultiGpu, BuffersThatCannotFitAreRefusedOnEveryRank) {
  if (!require_ranks()) return;
  const std::vector<std::exception_ptr> failures = creation_failures(gpu_ranks(), 8, [](int) {
    DeepEpOptions o;
    o.hidden = 7168;
    o.max_tokens_per_rank = 100'000'000;
    o.max_topk = 8;
    return o;
  });
  EXPECT_TRUE(all_threw<ArgumentError>(failures, argument_is("options", [](const std::string& m) {
    return contains(m, "the deepep buffers") && contains(m, "GiB of device memory, more than the");
  })));
}

// A rank that stops before a call: every other rank raises a TimeoutError naming that call's phase
// and the stopped rank within the deadline (3 s): budget mode's count exchange (raised by the next
// check_errors()), combine, dispatch_backward, combine_backward.
TEST_P(DeepEpMultiGpu, MissingPeerInEachPhaseTimesOutNamingPhaseAndPeer) {
  if (!require_ranks()) return;
  const int R = gpu_ranks(), E = 2 * R;
  const char* phases[] = {"deepep dispatch:count-exchange", "deepep combine:rows", "deepep dispatch_backward:rows",
                          "deepep combine_backward:rows"};
  for (int call = 0; call < 4; ++call) {
    SCOPED_TRACE(phases[call]);
    std::atomic<int> finished{0};
    std::vector<std::exception_ptr> failures(static_cast<std::size_t>(R));
    const auto errors = run_gpu_ranks(
        R,
        [&](GpuRank& g) {
          DeepEpOptions o = small_options(8, 16, g.stream);
          o.timeout_seconds = 3;
          auto d = make_deepep_dispatcher(g.comm, E, o);
          const DeviceInputs in = device_inputs(g, E, 16, 8, 1);
          DispatchOptions rm;
          rm.layout = DispatchLayout::rank_major;
          const auto stop = [&] {  // silent until the others gave up
            const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
            while (finished.load() < g.size - 1 && std::chrono::steady_clock::now() < until)
              std::this_thread::sleep_for(std::chrono::milliseconds(10));
          };
          try {
            if (call == 0) {
              if (g.rank == 1) return stop();
              DispatchOptions b = rm;
              b.mode = DispatchMode::budget;
              b.budget_rows = 16 * g.size;
              d->dispatch(in.view(), b);
              d->check_errors();
            } else {
              DispatchResult res = d->dispatch(in.view(), rm);
              if (g.rank == 1) return stop();
              if (call == 1) d->combine(res.handle, res.tokens);
              if (call == 2) d->dispatch_backward(res.handle, res.tokens, res.topk_weights);
              if (call == 3) d->combine_backward(res.handle, in.hidden);
            }
          } catch (...) {
            failures[static_cast<std::size_t>(g.rank)] = std::current_exception();
          }
          ++finished;
        },
        test_comm_options());
    ASSERT_TRUE(all_ok(errors));
    expect_timeouts(failures, 1, phases[call]);
  }
}

}  // namespace flexep::testing

namespace flexep::testing {

// One rank: every row stays on its GPU, through the same window and flags.
TEST(DeepEpOneRank, MatchesHost) {
  if (!require_gpus(1)) return;
  simulated_ranks() = 0;
  check_configs({config("uniform k2 H64", 4, 2, 64, {37}, RoutingKind::uniform, 1),
                 config("zipf k4 H7168 pad4", 8, 4, 7168, {20}, RoutingKind::zipf, 4)},
                1);
  check_against_host({config("expert-major zipf k4 H7168 pad4", 8, 4, 7168, tokens_for(gpu_ranks(), {300, 41}),
                             RoutingKind::zipf, 4)},
                     run_deepep_expert_major);
}

}  // namespace flexep::testing
