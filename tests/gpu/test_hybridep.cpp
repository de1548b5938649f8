// The hybridep backend on R = min(GPUs, 4) ranks (one thread per GPU) against the host backend on R
// simulated ranks, for the same inputs: dispatch (tokens, probs, tokens_per_expert, drops),
// combine, combine_backward and dispatch_backward are all compared bit for bit. Also: budget mode
// (exact size, room, drop counting, overflow error on every rank), the multihot form, run-to-run
// determinism, a CUDA graph of dispatch + experts + combine replayed 100 times with new inputs,
// SM counts, memory reporting, resize/release, stale handles, FP8 rows with their scales, errors
// raised on every rank (configuration mismatch, bad ids, bad arguments) and a missing peer turning
// into a TimeoutError that names the phase and the rank.
//
// OneRankPerGpu/HybridEpMultiGpu.<Test>/gpus runs every test with one rank per GPU (label multigpu);
// SimulatedRanks/HybridEpMultiGpu.<Test>/2ranks runs it again with the ranks sharing GPU 0
// (Communicator::simulate; label gpu, not multigpu): one GPU runs the kernels' multi-rank paths,
// with the peers' memory local instead of across NVLink. The three-rank variant is disabled, an
// open failure (see the instantiations).
//
// HybridEpOneRank (at the end) runs the same comparison with R = 1 on one GPU.
//
// Run order on a fresh machine (cheapest signal first): SmokeDispatchCombine, MatchesHostUniform,
// then the rest (see docs/hybridep.md, "Testing").
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "flexep/comm/host_world.h"
#include "flexep/core/random.h"
#include "flexep/core/routing.h"
#include "flexep/core/synthetic_routing.h"
#include "flexep/cuda/graph.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/dispatch/host.h"
#include "flexep/dispatch/hybridep.h"
#include "gpu/dispatch_harness.h"
#include "gpu/gpu_test_util.h"
#include "gpu/multi_gpu.h"
#include "gpu/rank_variants.h"

namespace flexep::testing {
namespace {

// A test's parameter: how many simulated ranks share GPU 0 (0: one rank per GPU).
class HybridEpMultiGpu : public RankVariantTest {};

INSTANTIATE_TEST_SUITE_P(OneRankPerGpu, HybridEpMultiGpu, ::testing::Values(Variant{0}), variant_name);
// Two ranks, as on the 2-GPU machine.
INSTANTIATE_TEST_SUITE_P(SimulatedRanks, HybridEpMultiGpu, ::testing::Values(Variant{2}), variant_name);
// Three ranks (a rank with two peers), which no machine so far could run: disabled (not discovered by
// ctest) until a device run passes them. On one H200, MemoryResizeReleaseAndStaleHandles failed in
// 2 of 2 runs (455815f, 86d9e77), BudgetModeMatchesHost in 2 of 3 and MatchesHostZipf in 1 of 3: the
// ranks timed out, one rank waiting for a peer's rows while that peer had already given up in the
// next wait. Each pattern is what one rank's kernel that could not run while its peers' kernels
// waited for it gives: a rank's device-wide synchronisation after init's last barrier (the zeroing
// now comes before the barrier, 66f894f, not yet run on a device), and two ranks' streams sharing a
// hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=32 in 86d9e77, after which the last two passed). Run:
//   flexep_gpu_tests --gtest_also_run_disabled_tests --gtest_filter='DISABLED_ThreeSimulatedRanks/*'
// with CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32; docs/hybridep.md, "Testing".
INSTANTIATE_TEST_SUITE_P(DISABLED_ThreeSimulatedRanks, HybridEpMultiGpu, ::testing::Values(Variant{3}),
                         variant_name);

// The GPUs a multi-rank test needs: two, or one for simulated ranks.
bool require_ranks() { return require_gpus(gpus_for_ranks(2)); }

// ---- the hybridep backend on one GPU rank -------------------------------------------------------------

HybridEpOptions hybridep_options(const Config& c, int R) {
  HybridEpOptions o;
  o.max_tokens_per_rank = 1;
  for (std::int64_t t : c.tokens) o.max_tokens_per_rank = std::max(o.max_tokens_per_rank, t);
  o.hidden = c.hidden;
  o.max_topk = c.multihot ? 0 : c.k;  // multihot: E slots
  o.max_pad_multiple = std::max<std::int64_t>(c.pad, 1);
  o.timeout_seconds = simulated_ranks() ? 20 : 60;  // simulated: every wait is on one GPU
  if (c.mode == DispatchMode::budget) {
    // The default capacity is the worst case of blocking mode; a budget above it needs room too.
    const int L = c.experts_per_rank, width = std::min(c.multihot ? L * R : c.k, L);
    const std::int64_t worst = R * o.max_tokens_per_rank * width + L * (o.max_pad_multiple - 1);
    o.max_recv_rows = std::max(worst, dispatch_options(c, R).budget_rows);
  }
  return o;
}

Outputs run_gpu_rank(GpuRank& g, HybridEpDispatcher& d, const Config& c, std::uint64_t seed = 1234) {
  auto up = [&](const Tensor& t) { return cuda::to_device(t, g.device, g.stream); };
  auto down = [&](const Tensor& t) { return t.device().is_cpu() ? t : cuda::to_host(t, g.stream); };
  // Budget mode returns no drop count on the host (no synchronisation): ask for it.
  auto dropped = [&](const DispatchResult& r) { return c.mode == DispatchMode::budget ? d.last_dropped() : r.dropped; };
  Outputs out =
      run_sequence(d, make_inputs(c, g.size, g.rank, seed), c, dispatch_options(c, g.size), g.rank, up, down, dropped);
  d.check_errors();  // budget mode raises device errors only here
  return out;
}

std::unique_ptr<HybridEpDispatcher> make_dispatcher(GpuRank& g, const Config& c) {
  HybridEpOptions o = hybridep_options(c, g.size);
  o.stream = g.stream;
  return make_hybridep_dispatcher(g.comm, c.experts_per_rank * g.size, o);
}

void check_against_host(const std::vector<Config>& configs) {
  ::flexep::testing::check_against_host(configs, [](GpuRank& g, const Config& c) {
    auto d = make_dispatcher(g, c);  // one dispatcher per config
    return run_gpu_rank(g, *d, c);
  });
}

// ---- bitwise agreement with the host backend ----------------------------------------------------------

TEST_P(HybridEpMultiGpu, SmokeDispatchCombine) {
  if (!require_ranks()) return;
  check_against_host({config("smoke E=2R k=1 H=8", 2, 1, 8, {5, 3, 4, 2})});
}

TEST_P(HybridEpMultiGpu, MatchesHostUniform) {
  if (!require_ranks()) return;
  Config i32 = config("uniform E=16R k=8 H=8 i32 ids", 16, 8, 8, {64, 100, 3, 0});
  i32.i32_indices = true;
  check_against_host({
      config("uniform E=2R k=1 H=8 pad 1", 2, 1, 8, {37, 0, 53, 11}),
      config("uniform E=2R k=1 H=8 pad 128", 2, 1, 8, {37, 0, 53, 11}, RoutingKind::uniform, 128),
      config("uniform E=16R k=8 H=8 pad 16", 16, 8, 8, {300, 257, 0, 129}, RoutingKind::uniform, 16),
      config("uniform E=1R k=1 H=2048", 1, 1, 2048, {513, 64, 0, 1}),
      config("uniform E=32R k=8 H=4096 pad 128", 32, 8, 4096, {700, 0, 333, 64}, RoutingKind::uniform, 128),
      config("uniform E=16R k=8 H=7168 pad 1", 16, 8, 7168, {2048, 0, 1000, 77}),
      config("uniform E=2R k=1 H=7168 pad 128", 2, 1, 7168, {0, 513, 64, 2048}, RoutingKind::uniform, 128),
      // Above 7168 the combine takes its 3-pipeline shape of 8 words per thread (clamped here).
      config("uniform E=16R k=8 H=7680 pad 16", 16, 8, 7680, {300, 0, 129, 64}, RoutingKind::uniform, 16),
      i32,
  });
}

TEST_P(HybridEpMultiGpu, MatchesHostZipf) {
  if (!require_ranks()) return;
  check_against_host({
      config("zipf E=16R k=8 H=7168 pad 1", 16, 8, 7168, {2048, 1024, 0, 512}, RoutingKind::zipf),
      config("zipf E=32R k=8 H=2048 pad 16", 32, 8, 2048, {500, 0, 333, 64}, RoutingKind::zipf, 16),
      config("zipf E=16R k=8 H=8 pad 128", 16, 8, 8, {500, 0, 333, 64}, RoutingKind::zipf, 128),
      config("zipf E=2R k=1 H=8 pad 1", 2, 1, 8, {0, 200, 17, 5}, RoutingKind::zipf),
      // Zipf top-48 of 64R experts puts most of a token's 48 rows on rank 0: more than 32 rows of one
      // token on one rank, so the kernels' 32-lane batches of rows wrap.
      config("zipf E=64R k=48 H=64 pad 1", 64, 48, 64, {40, 7, 0, 19}, RoutingKind::zipf),
  });
}

TEST_P(HybridEpMultiGpu, MatchesHostAllToOneExpert) {
  if (!require_ranks()) return;
  check_against_host({
      config("hot k=1 E=2R H=8", 2, 1, 8, {100, 0, 31, 7}, RoutingKind::hot),
      config("hot k=1 E=16R H=7168 pad 128", 16, 1, 7168, {1024, 2048, 0, 300}, RoutingKind::hot, 128),
      config("hot k=8 E=16R H=8", 16, 8, 8, {100, 64, 0, 9}, RoutingKind::hot),
      config("hot k=8 E=8R H=4096", 8, 8, 4096, {200, 0, 64, 9}, RoutingKind::hot),
      config("no tokens anywhere", 2, 2, 8, {0, 0, 0, 0}),
  });
}

TEST_P(HybridEpMultiGpu, MultihotGivesTheSameRowsAsTopK) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  Config topk = config("zipf E=16R k=8 H=8 pad 16", 16, 8, 8, {200, 0, 77, 31}, RoutingKind::zipf, 16);
  Config mh = topk;
  mh.name += " multihot";
  mh.multihot = true;
  const std::vector<Outputs> want_topk = run_host(topk, R), want_mh = run_host(mh, R);
  std::vector<Outputs> got_topk(static_cast<std::size_t>(R)), got_mh(static_cast<std::size_t>(R));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_dispatcher(g, mh);  // E slots: both forms fit
        got_topk[static_cast<std::size_t>(g.rank)] = run_gpu_rank(g, *d, topk);
        got_mh[static_cast<std::size_t>(g.rank)] = run_gpu_rank(g, *d, mh);
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  expect_equal(want_topk, got_topk, topk.name);
  expect_equal(want_mh, got_mh, mh.name);  // weight grads here are [T, E]
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const auto i = static_cast<std::size_t>(r);
    EXPECT_TRUE(same_bytes(got_topk[i].tokens, got_mh[i].tokens));
    EXPECT_TRUE(same_bytes(got_topk[i].combined, got_mh[i].combined));
    EXPECT_EQ(got_mh[i].grad_weights.size(1), 16 * R);
  }
}

TEST_P(HybridEpMultiGpu, BudgetModeMatchesHost) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  Config exact = config("budget exact size", 16, 8, 8, {300, 100, 0, 64}, RoutingKind::zipf, 16);
  exact.mode = DispatchMode::budget;  // budget = the largest rank's rows: one rank fills it exactly
  Config roomy = exact;
  roomy.name = "budget with room";
  roomy.budget_fraction = 1.5;
  Config drop = config("budget drop", 16, 8, 8, {300, 100, 0, 64}, RoutingKind::zipf, 16);
  drop.mode = DispatchMode::budget;
  drop.budget_fraction = 0.4;
  drop.overflow = OverflowPolicy::drop;
  Config drop_big = config("budget drop H=7168", 16, 8, 7168, {1024, 700, 0, 64}, RoutingKind::hot, 128);
  drop_big.mode = DispatchMode::budget;
  drop_big.budget_fraction = 0.3;
  drop_big.overflow = OverflowPolicy::drop;
  check_against_host({exact, roomy, drop, drop_big});
  std::int64_t dropped = 0;
  for (const Outputs& o : run_host(drop, R)) dropped += o.dropped;
  EXPECT_GT(dropped, 0);  // the drop case really drops (and the GPU matched the counts above)
}

TEST_P(HybridEpMultiGpu, BudgetOverflowRaisesOnEveryRankAtTheNextCheck) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  Config c = config("budget overflow", 16, 8, 8, {300, 100, 0, 64}, RoutingKind::zipf, 16);
  c.mode = DispatchMode::budget;
  c.budget_fraction = 0.5;
  c.overflow = OverflowPolicy::error;
  auto overflow = [](const Error& e) { return std::string(e.what()).find("overflow") != std::string::npos; };
  std::vector<std::exception_ptr> at_check(static_cast<std::size_t>(R));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_dispatcher(g, c);
        const Inputs in = make_inputs(c, R, g.rank);
        const DeviceInputs dev = to_device(in, g);
        const DispatchInput di = dev.view();
        d->dispatch(di, dispatch_options(c, R));  // budget mode: returns without waiting
        try {
          d->check_errors();
        } catch (...) {
          at_check[static_cast<std::size_t>(g.rank)] = std::current_exception();
        }
        d->check_errors();  // cleared: nothing left to raise
        Config fits = c;
        fits.budget_fraction = 1.0;
        DispatchResult ok = d->dispatch(di, dispatch_options(fits, R));  // the dispatcher still works
        d->combine(ok.handle, ok.tokens);
        d->check_errors();
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  EXPECT_TRUE(all_threw<Error>(at_check, overflow));

  // Without a check in between, the next blocking dispatch raises it: its preprocess kernel
  // publishes the status with the layout. Afterwards the dispatcher works again.
  std::vector<std::exception_ptr> at_dispatch(static_cast<std::size_t>(R));
  const auto errors2 = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_dispatcher(g, c);
        const Inputs in = make_inputs(c, R, g.rank);
        const DeviceInputs dev = to_device(in, g);
        const DispatchInput di = dev.view();
        d->dispatch(di, dispatch_options(c, R));  // budget overflow, recorded on the device only
        Config blocking = c;
        blocking.mode = DispatchMode::blocking;
        try {
          d->dispatch(di, dispatch_options(blocking, R));
        } catch (...) {
          at_dispatch[static_cast<std::size_t>(g.rank)] = std::current_exception();
        }
        DispatchResult ok = d->dispatch(di, dispatch_options(blocking, R));
        d->combine(ok.handle, ok.tokens);
        d->check_errors();
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors2));
  EXPECT_TRUE(all_threw<Error>(at_dispatch, overflow));
}

// ---- determinism -----------------------------------------------------------------------------------------

TEST_P(HybridEpMultiGpu, CombineIsIdenticalRunToRun) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  const Config c = config("zipf E=16R k=8 H=7168", 16, 8, 7168, {1024, 512, 0, 300}, RoutingKind::zipf);
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_dispatcher(g, c);
        const Outputs a = run_gpu_rank(g, *d, c), b = run_gpu_rank(g, *d, c);
        EXPECT_TRUE(same_bytes(a.tokens, b.tokens));
        EXPECT_TRUE(same_bytes(a.combined, b.combined));
        EXPECT_TRUE(same_bytes(a.grad_hidden, b.grad_hidden));
        EXPECT_TRUE(same_bytes(a.grad_weights, b.grad_weights));
        EXPECT_TRUE(same_bytes(a.grad_expert_out, b.grad_expert_out));
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
}

// ---- CUDA graph: dispatch + experts + combine, replayed with new inputs -------------------------------------

TEST_P(HybridEpMultiGpu, CudaGraphReplaysWithNewInputs) {
  if (!require_ranks()) return;
  // On simulated ranks, replays are separated by a host barrier. Without it (031e672 to 86d9e77) one
  // rank's graph kernels did not run from replay 1 on while a peer's waited for them; with it every
  // variant passes (c85e881). The likely cause: between replays a rank copies to and from pageable
  // host memory, and a driver call that synchronises the context (growing the pinned staging may)
  // then waits for the peer's spinning graph kernel, the deadlock of openxla/xla#5103. Two GPUs
  // need no barrier; the barrier does not order the replays' kernels, which still wait for each
  // other on the device.
  const int R = gpu_ranks(), replays = 100;
  Config c = config("graph", 4, 4, 64, {96, 0, 57, 128}, RoutingKind::uniform, 16);
  c.mode = DispatchMode::budget;
  c.budget_fraction = 1.0;
  // A budget no routing can exceed: every token to min(k, L) experts on one rank, plus padding.
  const int E = c.experts_per_rank * R, L = c.experts_per_rank;
  DispatchOptions o;
  o.mode = DispatchMode::budget;
  o.pad_multiple = c.pad;
  o.budget_rows = (R * 128 * std::min(c.k, L) + L * (c.pad - 1) + c.pad - 1) / c.pad * c.pad;

  // The host reference of every replay: experts = 2 * x (exact in bf16), identity combine.
  struct Want {
    Tensor tokens, probs, tpe, combined;
  };
  std::vector<std::vector<Want>> want(static_cast<std::size_t>(replays),
                                      std::vector<Want>(static_cast<std::size_t>(R)));
  for (int rep = 0; rep < replays; ++rep) {
    auto world = std::make_shared<HostWorld>(R, 60.0);
    Config cr = c;
    cr.routing.kind = rep % 3 == 0 ? RoutingKind::zipf : RoutingKind::uniform;
    const auto errors = run_ranks(R, [&](int r) {
      auto d = make_host_dispatcher(world, r, E);
      const Inputs in = make_inputs(cr, R, r, 500 + static_cast<std::uint64_t>(rep));
      DispatchInput di;
      di.hidden = in.hidden;
      di.indices = in.indices;
      di.weights = in.weights;
      DispatchResult res = d->dispatch(di, o);
      Tensor doubled = res.tokens.clone();
      for (std::int64_t i = 0; i < doubled.numel(); ++i)
        doubled.data<bf16>()[i] = bf16::from_float(2.0f * doubled.data<bf16>()[i].to_float());
      Want& w = want[static_cast<std::size_t>(rep)][static_cast<std::size_t>(r)];
      w.tokens = res.tokens;
      w.probs = res.token_probs;
      w.tpe = res.tokens_per_expert;
      w.combined = d->combine(res.handle, doubled);
    });
    ASSERT_TRUE(all_ok(errors));
  }

  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        HybridEpOptions ho = hybridep_options(c, g.size);
        ho.max_tokens_per_rank = 128;
        ho.max_recv_rows = o.budget_rows;
        ho.stream = g.stream;
        auto d = make_hybridep_dispatcher(g.comm, E, ho);
        const std::int64_t T = c.tokens[static_cast<std::size_t>(g.rank)], H = c.hidden, N = o.budget_rows;
        const Device dev = Device::cuda(g.device);
        const Tensor x = Tensor::zeros({T, H}, DType::bf16, dev);
        const Tensor idx = Tensor::zeros({T, c.k}, DType::i64, dev);  // expert 0 until the first copy
        const Tensor w = Tensor::zeros({T, c.k}, DType::f32, dev);
        const Tensor experts = Tensor::empty({N, H}, DType::bf16, dev);
        const Tensor out = Tensor::empty({T, H}, DType::bf16, dev);
        DispatchInput di;
        di.hidden = x;
        di.indices = idx;
        di.weights = w;
        for (std::int64_t t = 0; t < T; ++t) {  // a valid warm-up routing: slot j -> expert j
          std::vector<std::int64_t> row(static_cast<std::size_t>(c.k));
          for (int j = 0; j < c.k; ++j) row[static_cast<std::size_t>(j)] = j;
          FLEXEP_CUDA_CHECK(cudaMemcpyAsync(idx.data<std::int64_t>() + t * c.k, row.data(), c.k * 8,
                                            cudaMemcpyHostToDevice, g.stream));
        }
        // Warm-up outside the capture: loads the kernels and checks the path eagerly.
        DispatchResult warm = d->dispatch(di, o);
        d->combine_into(warm.handle, warm.tokens, out);
        d->check_errors();

        DispatchResult res;
        const cuda::CapturedGraph graph(g.stream, cudaStreamCaptureModeThreadLocal, [&] {
          res = d->dispatch(di, o);
          FLEXEP_CUDA_CHECK(cudaMemcpyAsync(experts.raw(), res.tokens.raw(), res.tokens.nbytes(),
                                            cudaMemcpyDeviceToDevice, g.stream));
          cuda::add_into(experts, res.tokens, g.stream);  // the "experts": y = 2 x
          d->combine_into(res.handle, experts, out);
        });
        Config cr = c;
        for (int rep = 0; rep < replays; ++rep) {
          SCOPED_TRACE("replay " + std::to_string(rep) + ", rank " + std::to_string(g.rank));
          cr.routing.kind = rep % 3 == 0 ? RoutingKind::zipf : RoutingKind::uniform;
          const Inputs in = make_inputs(cr, R, g.rank, 500 + static_cast<std::uint64_t>(rep));
          cuda::copy_async(x, in.hidden, g.stream);
          cuda::copy_async(idx, in.indices, g.stream);
          cuda::copy_async(w, in.weights, g.stream);
          if (simulated_ranks() > 0) {
            FLEXEP_CUDA_CHECK(cudaStreamSynchronize(g.stream));
            g.comm->barrier("graph replay");
          }
          graph.launch(g.stream);
          const Want& want_r = want[static_cast<std::size_t>(rep)][static_cast<std::size_t>(g.rank)];
          EXPECT_TRUE(same_bytes(want_r.tokens, cuda::to_host(res.tokens, g.stream))) << "tokens";
          EXPECT_TRUE(same_bytes(want_r.probs, cuda::to_host(res.token_probs, g.stream))) << "probs";
          EXPECT_TRUE(same_bytes(want_r.tpe, cuda::to_host(res.tokens_per_expert, g.stream))) << "tokens_per_expert";
          EXPECT_TRUE(same_bytes(want_r.combined, cuda::to_host(out, g.stream))) << "combine";
        }
        d->check_errors();
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
}

// ---- FP8 dispatch ------------------------------------------------------------------------------------------

// dispatch_fp8 moves e4m3 rows and their scales exactly like bf16 rows: the host backend, given the
// same bytes as bf16 containers ([T, H/2]) and the scales as f32 rows ([T, H/128]), places them in
// the same rows. Probs, tokens_per_expert and combine (bf16 expert outputs) match the bf16 reference.
TEST_P(HybridEpMultiGpu, Fp8DispatchMovesRowsAndScalesLikeBf16) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  for (const Config& base :
       {config("fp8 uniform E=16R k=8 H=2048 pad 16", 16, 8, 2048, {500, 0, 333, 64}, RoutingKind::uniform, 16),
        config("fp8 hot E=4R k=2 H=7168", 4, 2, 7168, {300, 200, 0, 17}, RoutingKind::hot)}) {
    SCOPED_TRACE(base.name);
    const int E = base.experts_per_rank * R;
    const std::int64_t H = base.hidden;
    // Per rank: random e4m3 bytes and scales, the routing of make_inputs.
    std::vector<Tensor> bytes(static_cast<std::size_t>(R)), scales(bytes);
    for (int r = 0; r < R; ++r) {
      Fp8Rows f = fp8_rows(base.tokens[static_cast<std::size_t>(r)], H, r);
      bytes[static_cast<std::size_t>(r)] = f.bytes;
      scales[static_cast<std::size_t>(r)] = f.scales;
    }
    // Host references: rows as bf16 containers, scales as f32 rows, and the bf16 run for combine.
    struct Want {
      Tensor rows, scales, probs, tpe, combined;
    };
    std::vector<Want> want(static_cast<std::size_t>(R));
    {
      auto world = std::make_shared<HostWorld>(R, 60.0);
      const auto errors = run_ranks(R, [&](int r) {
        auto d = make_host_dispatcher(world, r, E);
        const Inputs in = make_inputs(base, R, r);
        DispatchOptions o = dispatch_options(base, R);
        o.check_finite = false;  // random bytes viewed as bf16 may be NaN
        DispatchInput di;
        di.indices = in.indices;
        di.weights = in.weights;
        const std::int64_t T = in.hidden.size(0);
        di.hidden = TensorView(bytes[r].raw(), DType::bf16, {T, H / 2});
        DispatchResult a = d->dispatch(di, o);
        di.hidden = scales[r];
        DispatchResult b = d->dispatch(di, o);
        di.hidden = in.hidden;
        DispatchResult c = d->dispatch(di, o);
        Want& w = want[static_cast<std::size_t>(r)];
        w.rows = a.tokens;
        w.scales = b.tokens;
        w.probs = c.token_probs;
        w.tpe = c.tokens_per_expert;
        w.combined = d->combine(c.handle, random_tensor({c.tokens.size(0), H}, DType::bf16, 5, "expert_out", r));
      });
      ASSERT_TRUE(all_ok(errors));
    }
    const auto errors = run_gpu_ranks(
        R,
        [&](GpuRank& g) {
          HybridEpOptions ho = hybridep_options(base, g.size);
          ho.fp8 = true;
          ho.stream = g.stream;
          auto d = make_hybridep_dispatcher(g.comm, E, ho);
          const Inputs in = make_inputs(base, g.size, g.rank);
          const Tensor x = cuda::to_device(bytes[static_cast<std::size_t>(g.rank)], g.device, g.stream);
          const Tensor sc = cuda::to_device(scales[static_cast<std::size_t>(g.rank)], g.device, g.stream);
          const Tensor idx = cuda::to_device(in.indices, g.device, g.stream);
          const Tensor w = cuda::to_device(in.weights, g.device, g.stream);
          DispatchInput di;
          di.hidden = x;
          di.indices = idx;
          di.weights = w;
          HybridEpFp8Result res = d->dispatch_fp8(di, sc, dispatch_options(base, g.size));
          const Want& want_r = want[static_cast<std::size_t>(g.rank)];
          const Tensor rows = cuda::to_host(res.dispatch.tokens, g.stream);
          EXPECT_EQ(rows.dtype(), DType::e4m3);
          ASSERT_EQ(rows.nbytes(), want_r.rows.nbytes());
          EXPECT_EQ(std::memcmp(rows.raw(), want_r.rows.raw(), rows.nbytes()), 0) << "e4m3 rows";
          EXPECT_TRUE(same_bytes(want_r.scales, cuda::to_host(res.scales, g.stream))) << "scales";
          EXPECT_TRUE(same_bytes(want_r.probs, cuda::to_host(res.dispatch.token_probs, g.stream))) << "probs";
          EXPECT_TRUE(same_bytes(want_r.tpe, res.dispatch.tokens_per_expert)) << "tokens_per_expert";
          const std::int64_t N = res.dispatch.tokens.size(0);
          const Tensor eo =
              cuda::to_device(random_tensor({N, H}, DType::bf16, 5, "expert_out", g.rank), g.device, g.stream);
          EXPECT_TRUE(same_bytes(want_r.combined, cuda::to_host(d->combine(res.dispatch.handle, eo), g.stream)))
              << "combine after an FP8 dispatch";
          // A bf16 dispatch on the same dispatcher still works.
          const Tensor xb = cuda::to_device(in.hidden, g.device, g.stream);
          di.hidden = xb;
          d->dispatch(di, dispatch_options(base, g.size));
          d->check_errors();
        },
        test_comm_options());
    ASSERT_TRUE(all_ok(errors));
  }
}

// ---- SM counts, memory, resize, stale handles ---------------------------------------------------------------

TEST_P(HybridEpMultiGpu, SmCountsAreHonouredAndResultsUnchanged) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  const Config c = config("sms zipf E=16R k=8 H=2048", 16, 8, 2048, {700, 300, 0, 65}, RoutingKind::zipf, 16);
  const std::vector<Outputs> want = run_host(c, R);
  std::vector<std::vector<Outputs>> got(4, std::vector<Outputs>(static_cast<std::size_t>(R)));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_dispatcher(g, c);
        const std::vector<HybridEpSms> settings = {{1, 1, 1}, {3, 5, 2}, {16, 16, 20}, {0, 0, 0}};
        for (std::size_t i = 0; i < settings.size(); ++i) {
          d->set_num_sms(settings[i].dispatch, settings[i].combine, settings[i].preprocess);
          const HybridEpSms s = d->num_sms();
          if (i < 3) {
            EXPECT_EQ(s.dispatch, settings[i].dispatch);
            EXPECT_EQ(s.combine, settings[i].combine);
            EXPECT_EQ(s.preprocess, settings[i].preprocess);
          } else {
            EXPECT_EQ(s.dispatch, hybridep_num_sms().dispatch);  // 0: the process-wide setting
          }
          got[i][static_cast<std::size_t>(g.rank)] = run_gpu_rank(g, *d, c);
        }
        EXPECT_THROW(d->set_num_sms(100000), ArgumentError);
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  for (std::size_t i = 0; i < got.size(); ++i) expect_equal(want, got[i], c.name + " sms setting " + std::to_string(i));
}

// HybridEpOptions::part_tokens (the kernels' work item, for sweeps): every size gives the host
// backend's results; an invalid one is refused naming the option.
TEST_P(HybridEpMultiGpu, PartSizesChangeNoResult) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  const Config c = config("parts zipf E=16R k=8 H=2048", 16, 8, 2048, {700, 300, 0, 65}, RoutingKind::zipf, 16);
  const std::vector<Outputs> want = run_host(c, R);
  const std::vector<int> sizes = {1, 2, 4, 8, 16, 32};
  std::vector<std::vector<Outputs>> got(sizes.size(), std::vector<Outputs>(static_cast<std::size_t>(R)));
  std::vector<std::exception_ptr> bad(static_cast<std::size_t>(R));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          HybridEpOptions o = hybridep_options(c, g.size);
          o.stream = g.stream;
          o.part_tokens = sizes[i];
          auto d = make_hybridep_dispatcher(g.comm, c.experts_per_rank * g.size, o);
          got[i][static_cast<std::size_t>(g.rank)] = run_gpu_rank(g, *d, c);
        }
        HybridEpOptions o = hybridep_options(c, g.size);
        o.part_tokens = 12;
        try {
          make_hybridep_dispatcher(g.comm, c.experts_per_rank * g.size, o);
        } catch (...) {
          bad[static_cast<std::size_t>(g.rank)] = std::current_exception();
        }
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  for (std::size_t i = 0; i < sizes.size(); ++i)
    expect_equal(want, got[i], c.name + " part_tokens " + std::to_string(sizes[i]));
  EXPECT_TRUE(all_threw<ArgumentError>(bad, [](const ArgumentError& e) { return e.argument() == "part_tokens"; }));
}

// kernel_timing: the steps of the last dispatch, stamped on the device by every CTA, come in the
// protocol's order (a step's earliest and latest stamp never before the previous step's) and lie
// within the events around the kernels; the results stay the host backend's.
TEST_P(HybridEpMultiGpu, KernelTimingStepsInOrder) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  // At most 256 tokens per rank: the inline plan (its step too); a rank with none still sends flags.
  const Config c = config("timed E=16R k=8 H=2048", 16, 8, 2048, {200, 130, 0, 64});
  const std::vector<Outputs> want = run_host(c, R);
  std::vector<Outputs> got(static_cast<std::size_t>(R));
  std::vector<HybridEpKernelTimes> times(static_cast<std::size_t>(R));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        HybridEpOptions o = hybridep_options(c, g.size);
        o.stream = g.stream;
        o.kernel_timing = true;
        auto d = make_hybridep_dispatcher(g.comm, c.experts_per_rank * g.size, o);
        got[static_cast<std::size_t>(g.rank)] = run_gpu_rank(g, *d, c);
        times[static_cast<std::size_t>(g.rank)] = d->kernel_times();
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  expect_equal(want, got, c.name);

  // Every rank's T fits one plan chunk and k = 8: the dispatch runs the fused kernel (the preprocess steps in
  // the dispatch CTAs; each producer stages its parts' tokens, stamping the first lane's token) on
  // every rank whose parts give each pipeline one (rank 0's 200 tokens do at the default 20 SMs);
  // a rank with fewer parts takes the two kernels.
  EXPECT_TRUE(times[0].one_kernel);
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const bool fused = times[static_cast<std::size_t>(r)].one_kernel;
    const bool tokens = c.tokens[static_cast<std::size_t>(r)] > 0;  // else no token is staged or sent
    std::vector<std::string> steps = {"preprocess_start", "planned",     "counts_sent", "slots_ranked",
                                      "counts_arrived",   "layout_done", "published"};
    if (tokens) steps.insert(steps.end(), {"staging_loaded", "staging_stored"});
    if (!fused) steps.emplace_back("staged");
    steps.insert(steps.end(), {"dispatch_start", "producer_start", "probs_written", "loads_posted", "records_copied",
                               "first_job"});
    if (tokens) steps.emplace_back("first_stores");
    steps.insert(steps.end(), {"sends_posted", "chunk_released", "flag_arrived", "fan_out_posted", "stores_done",
                               "zeroed", "dispatch_end"});
    const HybridEpKernelTimes& t = times[static_cast<std::size_t>(r)];
    std::map<std::string, HybridEpPhase> at;
    for (const HybridEpPhase& p : t.dispatch_phases) at[p.name] = p;
    ASSERT_EQ(at.size(), steps.size());
    for (const std::string& s : steps) ASSERT_EQ(at.count(s), 1u) << s;
    EXPECT_EQ(at["preprocess_start"].first, 0.0);
    // The device clock ticks in ~1 us steps; the events bracket the kernels.
    const double end = t.plan + t.preprocess + t.dispatch + 5.0;
    for (const HybridEpPhase& p : t.dispatch_phases) {
      EXPECT_LE(p.first, p.last) << p.name;
      EXPECT_GE(p.first, 0.0) << p.name;
      EXPECT_LE(p.last, end) << p.name;
    }
    const auto in_order = [&](const std::string& a, const std::string& b) {
      EXPECT_LE(at[a].first, at[b].first) << a << " before " << b;
      EXPECT_LE(at[a].last, at[b].last) << a << " before " << b;
    };
    for (std::size_t i = 1; i < 5; ++i) in_order(steps[i - 1], steps[i]);  // each preprocess CTA's steps
    EXPECT_LE(at["layout_done"].first, at["published"].first);  // CTA 0 alone publishes
    if (tokens) {  // the first token of a staging CTA or producer, after that CTA's layout
      EXPECT_LE(at["layout_done"].first, at["staging_loaded"].first);
      in_order("staging_loaded", "staging_stored");
      if (!fused) {
        EXPECT_LE(at["staging_stored"].last, at["staged"].last);
      }
    }
    if (fused) {
      in_order("layout_done", "dispatch_start");  // each CTA's roles start after its own layout
    } else {
      // The dispatch kernel starts after the whole preprocess grid (stream order: no dependent
      // launch with kernel_timing).
      EXPECT_LE(at["staged"].last, at["dispatch_start"].first);
    }
    // Each producer's steps in every send part, and each consumer's first job before its first stores.
    for (const char* s : {"producer_start", "first_job"}) EXPECT_LE(at["dispatch_start"].first, at[s].first) << s;
    if (fused && tokens) {
      // A producer ranks its part's rows, posts their loads, stages the records and writes its probs.
      // Only the first and the last stamps are ordered: a part can be empty (loads and probs stamped,
      // nothing staged), and a producer may get none.
      EXPECT_LE(at["producer_start"].first, at["staging_loaded"].first);
      EXPECT_LE(at["staging_stored"].last, at["probs_written"].last);
    }
    // Every producer stamps its start, only those with a send part its probs (and every consumer its
    // first job, only those with a row its first stores): the first stamps are ordered, the last
    // ones need not be.
    EXPECT_LE(at["producer_start"].first, at["probs_written"].first);
    if (fused) {  // the row loads (and the rows' notes) first, then the staging and the probs
      in_order("loads_posted", "probs_written");
      in_order("probs_written", "records_copied");
    } else {
      in_order("probs_written", "loads_posted");
      in_order("loads_posted", "records_copied");
    }
    EXPECT_LE(at["records_copied"].last, at["sends_posted"].last);
    if (tokens) {
      EXPECT_LE(at["first_job"].first, at["first_stores"].first);
    }
    in_order("dispatch_start", "sends_posted");
    in_order("sends_posted", "fan_out_posted");
    for (const char* s : {"chunk_released", "flag_arrived", "stores_done", "zeroed"}) {
      EXPECT_LE(at["dispatch_start"].first, at[s].first) << s;
      EXPECT_LE(at[s].last, at["dispatch_end"].last) << s;
    }
    EXPECT_LE(at["fan_out_posted"].last, at["dispatch_end"].last);
    EXPECT_LE(at["chunk_released"].last, at["stores_done"].last);  // a consumer publishes, then finishes
  }
}

TEST_P(HybridEpMultiGpu, MemoryResizeReleaseAndStaleHandles) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  const Config small = config("small", 4, 2, 64, {40, 20, 0, 8});
  Config big = small;
  big.name = "big";
  big.tokens = {300, 10, 256, 0};
  const std::vector<Outputs> want_small = run_host(small, R), want_big = run_host(big, R);
  std::vector<Outputs> got_small(static_cast<std::size_t>(R)), got_big(static_cast<std::size_t>(R));
  std::vector<std::exception_ptr> stale(static_cast<std::size_t>(R));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_dispatcher(g, small);
        const int E = small.experts_per_rank * g.size;
        HybridEpOptions o = hybridep_options(small, g.size);
        o.stream = g.stream;
        EXPECT_EQ(d->memory().total(), HybridEpDispatcher::size_hint(o, g.size, E).total());
        EXPECT_GT(d->memory().dispatch_window, 0u);
        EXPECT_GT(d->memory().combine_window, 0u);

        // A handle is valid until the next dispatch on the same dispatcher.
        const Inputs in = make_inputs(small, g.size, g.rank);
        const DeviceInputs dev = to_device(in, g);
        const DispatchInput di = dev.view();
        DispatchResult first = d->dispatch(di, {});
        DispatchResult second = d->dispatch(di, {});
        try {
          d->combine(first.handle, first.tokens);
        } catch (...) {
          stale[static_cast<std::size_t>(g.rank)] = std::current_exception();
        }
        d->combine(second.handle, second.tokens);  // the current one works (all ranks call it)

        d->release();
        EXPECT_EQ(d->memory().total(), 0u);
        got_small[static_cast<std::size_t>(g.rank)] = run_gpu_rank(g, *d, small);  // re-initialises
        HybridEpOptions ob = hybridep_options(big, g.size);
        ob.stream = g.stream;
        d->resize(ob);
        EXPECT_EQ(d->memory().total(), HybridEpDispatcher::size_hint(ob, g.size, E).total());
        got_big[static_cast<std::size_t>(g.rank)] = run_gpu_rank(g, *d, big);
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  expect_equal(want_small, got_small, small.name);
  expect_equal(want_big, got_big, big.name);
  EXPECT_TRUE(all_threw<ArgumentError>(stale, [](const ArgumentError& e) {
    return e.argument() == "handle" && std::string(e.what()).find("stale") != std::string::npos;
  }));
}

// ---- errors raised on every rank ---------------------------------------------------------------------------

std::unique_ptr<HybridEpDispatcher> small_dispatcher(GpuRank& g, int E, std::int64_t H, double timeout = 60) {
  HybridEpOptions o;
  o.max_tokens_per_rank = 64;
  o.hidden = H;
  o.max_topk = 4;
  o.timeout_seconds = timeout;
  o.stream = g.stream;
  return make_hybridep_dispatcher(g.comm, E, o);
}

TEST_P(HybridEpMultiGpu, ConfigMismatchRaisesOnEveryRank) {
  if (!require_ranks()) return;
  const int R = gpu_ranks(), E = 4 * R;
  std::vector<std::exception_ptr> mismatch_h(static_cast<std::size_t>(R)), mismatch_k(mismatch_h);
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = small_dispatcher(g, E, 8);
        const std::size_t r = static_cast<std::size_t>(g.rank);
        try {  // rank 1 passes H = 16 to a dispatcher made for H = 8: its checks fail
          d->dispatch(device_inputs(g, E, 20, g.rank == 1 ? 16 : 8, 2).view(), {});
        } catch (...) {
          mismatch_h[r] = std::current_exception();
        }
        try {  // rank 1 routes to top-3, the others to top-2: the headers differ
          d->dispatch(device_inputs(g, E, 20, 8, g.rank == 1 ? 3 : 2).view(), {});
        } catch (...) {
          mismatch_k[r] = std::current_exception();
        }
        d->dispatch(device_inputs(g, E, 20, 8, 2).view(), {});  // still in step
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  EXPECT_TRUE(all_threw<ArgumentError>(mismatch_h, argument_is("hidden", [](const std::string&) { return true; })));
  for (int r = 0; r < R; ++r)
    if (r != 1) {
      EXPECT_TRUE(contains(what_of(mismatch_h[static_cast<std::size_t>(r)]), "rank 1 failed its checks"));
    }
  EXPECT_TRUE(all_threw<ArgumentError>(mismatch_k, argument_is("indices", [](const std::string& w) {
                                         return contains(w, "rank 1 has k=3 but rank 0 has k=2");
                                       })));
}

TEST_P(HybridEpMultiGpu, NumExpertsMismatchRaisesOnEveryRank) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  const auto errors = run_gpu_ranks(
      R, [&](GpuRank& g) { small_dispatcher(g, g.rank == 1 ? 4 * R : 2 * R, 8); }, test_comm_options());
  EXPECT_TRUE(all_threw<ArgumentError>(errors, argument_is("num_experts", [&](const std::string& w) {
                                         return contains(w, "rank 1 has E=" + std::to_string(4 * R) +
                                                                " but rank 0 has E=" + std::to_string(2 * R));
                                       })));
}

// Buffers larger than the GPU's free memory (10^8 tokens per rank at H 7168) are refused by every
// rank before any allocation, naming `options` with the GiB needed and free; the rank whose check
// failed raises its own error, the others the agreed one.
TEST_P(HybridEpMultiGpu, BuffersThatCannotFitAreRefusedOnEveryRank) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        HybridEpOptions o;
        o.hidden = 7168;
        o.max_tokens_per_rank = 100'000'000;
        o.max_topk = 8;
        o.stream = g.stream;
        make_hybridep_dispatcher(g.comm, 8 * R, o);
      },
      test_comm_options());
  EXPECT_TRUE(all_threw<ArgumentError>(errors, argument_is("options", [](const std::string& m) {
    return (contains(m, "the hybridep buffers") && contains(m, "GiB of device memory, more than the")) ||
           contains(m, "rejected its hybridep options");
  })));
}

// An argument error found on one rank in combine or a backward reaches every rank as an
// ArgumentError naming that argument: the failing rank's kernel still releases its flags, with its
// abort words beside them (Dispatcher::stop_together), instead of leaving its peers to time out.
// The dispatcher stays usable, and a combine afterwards gives the same bits as before.
TEST_P(HybridEpMultiGpu, ErrorsInCombineAndBackwardsReachEveryRank) {
  if (!require_ranks()) return;
  const int R = gpu_ranks(), E = 2 * R;
  const std::int64_t T = 6, H = 8;
  std::vector<std::exception_ptr> combine(static_cast<std::size_t>(R)), grads(combine), rows(combine), handle(combine);
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = small_dispatcher(g, E, H, 10);
        const std::size_t r = static_cast<std::size_t>(g.rank);
        const DispatchResult res = d->dispatch(device_inputs(g, E, T, H, 2).view(), {});
        const std::int64_t N = res.tokens.size(0);
        const Device dev = Device::cuda(g.device);
        const Tensor before = cuda::to_host(d->combine(res.handle, res.tokens), g.stream);
        const int last = g.size - 1;
        attempt(combine[r], [&] {  // the last rank's expert_out has one row too many
          const Tensor bad = Tensor::zeros({N + 1, H}, DType::bf16, dev);
          d->combine(res.handle, g.rank == last ? TensorView(bad) : TensorView(res.tokens));
        });
        attempt(grads[r], [&] {  // rank 0's prob gradients have a row too many
          const Tensor bad = Tensor::zeros({N + 1}, DType::f32, dev);
          d->dispatch_backward(res.handle, res.tokens, g.rank == 0 ? TensorView(bad) : TensorView(res.token_probs));
        });
        attempt(rows[r], [&] {  // the last rank's grad_out is of the wrong width
          const Tensor go = Tensor::zeros({T, g.rank == last ? H + 8 : H}, DType::bf16, dev);
          d->combine_backward(res.handle, go);
        });
        attempt(handle[r], [&] { d->combine(g.rank == 0 ? Handle() : res.handle, res.tokens); });
        const Tensor after = cuda::to_host(d->combine(res.handle, res.tokens), g.stream);  // still usable
        d->check_errors();
        EXPECT_TRUE(same_bytes(before, after)) << "rank " << g.rank;
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  const int last = R - 1;
  auto names = [](const char* arg) { return argument_is(arg, [](const std::string&) { return true; }); };
  EXPECT_TRUE(all_threw<ArgumentError>(combine, names("expert_out")));
  EXPECT_TRUE(all_threw<ArgumentError>(grads, names("grad_token_probs")));
  EXPECT_TRUE(all_threw<ArgumentError>(rows, names("grad_out")));
  EXPECT_TRUE(all_threw<ArgumentError>(handle, names("handle")));
  for (int r = 0; r < R; ++r) {
    const auto at = static_cast<std::size_t>(r);
    if (r != last) {
      EXPECT_TRUE(contains(what_of(combine[at]), "rank " + std::to_string(last) + " failed its checks in combine:partials"))
          << what_of(combine[at]);
      EXPECT_TRUE(contains(what_of(rows[at]), "rank " + std::to_string(last) + " failed its checks in combine_backward:rows"))
          << what_of(rows[at]);
    }
    if (r != 0) {
      EXPECT_TRUE(contains(what_of(grads[at]), "rank 0 failed its checks in dispatch_backward:partials"))
          << what_of(grads[at]);
      EXPECT_TRUE(contains(what_of(handle[at]), "rank 0 failed its checks in combine:partials")) << what_of(handle[at]);
    }
  }
}

TEST_P(HybridEpMultiGpu, BadIdsAndBadArgumentsRaiseOnEveryRank) {
  if (!require_ranks()) return;
  const int R = gpu_ranks(), E = 2 * R;
  std::vector<std::exception_ptr> bad_id(static_cast<std::size_t>(R)), repeated(bad_id), bad_dtype(bad_id),
      rank_major(bad_id);
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = small_dispatcher(g, E, 8);
        const std::size_t r = static_cast<std::size_t>(g.rank);
        const int last = g.size - 1;
        try {  // the last rank routes token 2 to expert E
          TopK tk = synthetic_topk(6, 2, E, RoutingSpec{}, 3, g.rank);
          if (g.rank == last) tk.indices.data<std::int64_t>()[2 * 2 + 1] = E;
          DeviceInputs in = device_inputs(g, E, 6, 8, 2);
          in.indices = cuda::to_device(tk.indices, g.device, g.stream);
          d->dispatch(in.view(), {});
        } catch (...) {
          bad_id[r] = std::current_exception();
        }
        try {  // rank 0 lists expert 1 twice in token 4
          TopK tk = synthetic_topk(6, 2, E, RoutingSpec{}, 3, g.rank);
          if (g.rank == 0) {
            tk.indices.data<std::int64_t>()[4 * 2] = 1;
            tk.indices.data<std::int64_t>()[4 * 2 + 1] = 1;
          }
          DeviceInputs in = device_inputs(g, E, 6, 8, 2);
          in.indices = cuda::to_device(tk.indices, g.device, g.stream);
          d->dispatch(in.view(), {});
        } catch (...) {
          repeated[r] = std::current_exception();
        }
        try {  // rank 1 passes f64 weights
          DeviceInputs in = device_inputs(g, E, 6, 8, 2);
          if (g.rank == 1) in.weights = cuda::to_device(Tensor::zeros({6, 2}, DType::f64), g.device, g.stream);
          d->dispatch(in.view(), {});
        } catch (...) {
          bad_dtype[r] = std::current_exception();
        }
        try {  // every rank asks for DeepEP's layout, which hybridep does not write
          DispatchOptions o;
          o.layout = DispatchLayout::rank_major;
          d->dispatch(device_inputs(g, E, 6, 8, 2).view(), o);
        } catch (...) {
          rank_major[r] = std::current_exception();
        }
        DispatchResult ok = d->dispatch(device_inputs(g, E, 6, 8, 2).view(), {});  // the records were cleared
        d->combine(ok.handle, ok.tokens);
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  EXPECT_TRUE(all_threw<ArgumentError>(bad_id, argument_is("indices", [&](const std::string& w) {
                                         return contains(w,
                                                         "value " + std::to_string(E) + " at [2, 1] is out of range");
                                       })));
  EXPECT_TRUE(all_threw<ArgumentError>(repeated, argument_is("indices", [](const std::string& w) {
                                         return contains(w, "token 4 lists expert 1 twice");
                                       })));
  EXPECT_TRUE(all_threw<ArgumentError>(bad_dtype, argument_is("weights", [](const std::string&) { return true; })));
  EXPECT_TRUE(all_threw<ArgumentError>(rank_major, argument_is("options.layout", [](const std::string& w) {
                                         return contains(w, "the hybridep backend does not write");
                                       })));
  for (int r = 0; r < R; ++r)
    if (r != 1) {
      EXPECT_TRUE(contains(what_of(bad_dtype[static_cast<std::size_t>(r)]), "rank 1 failed its checks"));
    }
}

// ---- a rank that stops participating ---------------------------------------------------------------------

// Rank 1 skips `skipped_call` (0: the second dispatch, 1: a combine, 2: a dispatch_backward, 3: a
// combine_backward); the others must fail with a TimeoutError naming `phase` and rank 1 within the
// 3 s device deadline (plus slack).
void check_missing_peer(int skipped_call, const std::string& phase) {
  const int R = gpu_ranks(), E = 2 * R;
  std::atomic<int> finished{0};
  std::vector<double> seconds(static_cast<std::size_t>(R), 0.0);
  std::vector<std::exception_ptr> failures(static_cast<std::size_t>(R));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = small_dispatcher(g, E, 8, 3.0);
        const DeviceInputs in = device_inputs(g, E, 16, 8, 1);
        DispatchResult res = d->dispatch(in.view(), {});  // all ranks: works
        if (g.rank == 1) {
          // Stay alive (and silent) until the others gave up.
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
          while (finished.load() < g.size - 1 && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          const Tensor x = random_tensor({res.tokens.size(0), 8}, DType::bf16, 2, "x", g.rank);
          const Tensor rows = cuda::to_device(x, g.device, g.stream);
          if (skipped_call == 0) d->dispatch(in.view(), {});
          if (skipped_call == 1) d->combine(res.handle, rows);
          if (skipped_call == 2) d->dispatch_backward(res.handle, rows, res.token_probs);
          if (skipped_call == 3) d->combine_backward(res.handle, in.hidden);
        } catch (...) {
          failures[static_cast<std::size_t>(g.rank)] = std::current_exception();
        }
        seconds[static_cast<std::size_t>(g.rank)] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        // After a timeout the dispatcher refuses further calls (the ranks are out of step).
        EXPECT_THROW(d->dispatch(in.view(), {}), Error);
        ++finished;
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  for (int r = 0; r < R; ++r) {
    if (r == 1) continue;
    SCOPED_TRACE("rank " + std::to_string(r));
    const std::exception_ptr& e = failures[static_cast<std::size_t>(r)];
    ASSERT_TRUE(e != nullptr) << "no error";
    try {
      std::rethrow_exception(e);
    } catch (const TimeoutError& t) {
      EXPECT_EQ(t.phase(), phase) << t.what();
      EXPECT_EQ(t.peer(), 1) << t.what();
    } catch (...) {
      ADD_FAILURE() << "not a TimeoutError: " << what_of(e);
    }
    EXPECT_GE(seconds[static_cast<std::size_t>(r)], 2.5);
    EXPECT_LT(seconds[static_cast<std::size_t>(r)], 30.0);
  }
}

TEST_P(HybridEpMultiGpu, MissingPeerInDispatchTimesOutNamingPhaseAndPeer) {
  if (!require_ranks()) return;
  check_missing_peer(0, "dispatch:count-exchange");
}

TEST_P(HybridEpMultiGpu, MissingPeerInCombineTimesOutNamingPhaseAndPeer) {
  if (!require_ranks()) return;
  check_missing_peer(1, "combine:partials");
}

TEST_P(HybridEpMultiGpu, MissingPeerInTheBackwardsTimesOutNamingPhaseAndPeer) {
  if (!require_ranks()) return;
  check_missing_peer(2, "dispatch_backward:partials");
  check_missing_peer(3, "combine_backward:rows");
}

// ---- one rank on one GPU ----------------------------------------------------------------------------

// The kernels with R = 1 (an expert-parallel size of one, which a user may run): every row is local,
// so there is no peer, no NVLink and no fan-out, but the fused kernel's inline plan and layout, the
// rings, parts, held rows, zeroing, the combine and the backwards run as with more ranks. Not a
// multi-GPU test (label gpu only): on a one-GPU machine it is the check of those mechanics that the
// multi-GPU tests cannot give there.
class HybridEpOneRank : public HybridEpMultiGpu {};

INSTANTIATE_TEST_SUITE_P(OneRankPerGpu, HybridEpOneRank, ::testing::Values(Variant{0}), variant_name);

TEST_P(HybridEpOneRank, MatchesHostAtSeveralSmCountsAndPartSizes) {
  if (!require_gpus(1)) return;
  Config budget = config("one rank budget E=16 k=8 H=2048 pad 16", 16, 8, 2048, {300}, RoutingKind::zipf, 16);
  budget.mode = DispatchMode::budget;
  budget.budget_fraction = 1.25;
  const std::vector<Config> configs = {
      config("one rank decode E=64 k=8 H=7168", 64, 8, 7168, {128}),
      config("one rank zipf E=64 k=8 H=7168 pad 16", 64, 8, 7168, {1000}, RoutingKind::zipf, 16),
      config("one rank uniform E=32 k=8 H=2048 pad 128", 32, 8, 2048, {700}, RoutingKind::uniform, 128),
      config("one rank hot E=8 k=1 H=8", 8, 1, 8, {100}, RoutingKind::hot),
      config("one rank T=0 E=4 k=2 H=64", 4, 2, 64, {0}),
      budget,
  };
  // {dispatch SMs, part_tokens}: at 4 SMs with 2-token parts every pipeline of the fused kernel
  // holds the local rows of several parts; 32 and 64 SMs give decode parts of 2 and 1 tokens (held
  // rows, one part per pipeline), 16 SMs 4-token parts (nothing held).
  const std::vector<std::pair<int, int>> settings = {{4, 2}, {16, 0}, {32, 0}, {64, 0}};
  std::vector<std::vector<Outputs>> want;
  for (const Config& c : configs) want.push_back(run_host(c, 1));
  std::vector<std::vector<Outputs>> got(settings.size() * configs.size(), std::vector<Outputs>(1));
  const auto errors = run_gpu_ranks(
      1,
      [&](GpuRank& g) {
        for (std::size_t s = 0; s < settings.size(); ++s)
          for (std::size_t i = 0; i < configs.size(); ++i) {
            HybridEpOptions o = hybridep_options(configs[i], 1);
            o.stream = g.stream;
            o.part_tokens = settings[s].second;
            auto d = make_hybridep_dispatcher(g.comm, configs[i].experts_per_rank, o);
            d->set_num_sms(settings[s].first, settings[s].first, settings[s].first);
            got[s * configs.size() + i][0] = run_gpu_rank(g, *d, configs[i]);
          }
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  for (std::size_t s = 0; s < settings.size(); ++s)
    for (std::size_t i = 0; i < configs.size(); ++i)
      expect_equal(want[i], got[s * configs.size() + i],
                   configs[i].name + " at " + std::to_string(settings[s].first) + " SMs, part_tokens " +
                       std::to_string(settings[s].second));
}

}  // namespace
}  // namespace flexep::testing
