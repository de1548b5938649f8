// deepep's low-latency mode (DeepEP's LL) against its CPU oracle (core/low_latency.h), bit for bit:
// recv_x (bf16 and e4m3 rows, with the scales), recv_count, recv_src_info, layout_range and the
// weighted combine; uniform, Zipf and one hot expert, a rank with T = 0, k from 1 to 8, H from 64
// to 7168, int32 ids; repeated calls (growing epochs) with a normal-mode dispatch between them; a
// dispatch + combine replayed in a CUDA graph; bad ids raised by check_errors(); argument errors
// by name; a missing peer as a TimeoutError naming the phase and the rank.
//
// OneRankPerGpu/DeepEpLowLatencyMultiGpu.<Test>/gpus: one rank per GPU (label multigpu);
// SimulatedRanks/...: two and four ranks sharing GPU 0 (label gpu).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <latch>
#include <thread>

#include "flexep/core/low_latency.h"
#include "flexep/cuda/graph.h"
#include "flexep/dispatch/deepep.h"
#include "gpu/dispatch_harness.h"
#include "gpu/gpu_test_util.h"
#include "gpu/multi_gpu.h"
#include "gpu/rank_variants.h"

namespace flexep::testing {
namespace {

class DeepEpLowLatencyMultiGpu : public RankVariantTest {};

INSTANTIATE_TEST_SUITE_P(OneRankPerGpu, DeepEpLowLatencyMultiGpu, ::testing::Values(Variant{0}), variant_name);
INSTANTIATE_TEST_SUITE_P(SimulatedRanks, DeepEpLowLatencyMultiGpu, ::testing::Values(Variant{2}, Variant{4}),
                         variant_name);

bool require_ranks() { return require_gpus(gpus_for_ranks(2)); }

std::vector<std::int64_t> tokens_for(int R, std::vector<std::int64_t> pattern) {
  std::vector<std::int64_t> t;
  for (int r = 0; r < R; ++r) t.push_back(pattern[static_cast<std::size_t>(r) % pattern.size()]);
  return t;
}

struct Case {
  Config c;
  bool fp8 = false;
  std::int64_t max_tokens = 0;  // T_ll
};

DeepEpOptions options_for(const Case& cs, int R, cudaStream_t stream) {
  DeepEpOptions o;
  o.hidden = cs.c.hidden;
  o.max_tokens_per_rank = 8;
  o.max_topk = std::min(8, cs.c.experts_per_rank * R);
  o.low_latency_max_tokens = cs.max_tokens;
  o.sms = 8;  // every CTA resident: four simulated ranks share the GPU's SMs
  o.timeout_seconds = 20;
  o.stream = stream;
  return o;
}

// One rank's inputs: the routing of make_inputs, the rows bf16 or e4m3 bytes with their scales.
struct LowLatencyInputs {
  Inputs in;
  Tensor x, scales;
};

LowLatencyInputs inputs_for(const Case& cs, int R, int r, std::uint64_t seed) {
  LowLatencyInputs li;
  li.in = make_inputs(cs.c, R, r, seed);
  const std::int64_t T = li.in.hidden.size(0), H = cs.c.hidden;
  if (!cs.fp8) {
    li.x = li.in.hidden;
    return li;
  }
  li.x = Tensor::empty({T, H}, DType::e4m3);
  auto* b = static_cast<std::uint8_t*>(li.x.raw());
  for (std::int64_t i = 0; i < T * H; ++i) b[i] = static_cast<std::uint8_t>(splitmix64(seed + i * 31 + r) & 0xff);
  li.scales = random_tensor({T, H / 128}, DType::f32, seed + 77, "scales", r);
  return li;
}

// Rank d's expert outputs [L, R * T_ll, H]: wide-range values, so any other order of the
// weighted sum gives other bits.
Tensor expert_outputs(const Case& cs, int R, int d, std::uint64_t seed) {
  const std::int64_t rows = static_cast<std::int64_t>(cs.c.experts_per_rank) * R * cs.max_tokens;
  const Tensor flat = wide_range_rows(rows, cs.c.hidden, seed, "expert_out", d);
  Tensor out = Tensor::empty({cs.c.experts_per_rank, R * cs.max_tokens, cs.c.hidden}, DType::bf16);
  std::memcpy(out.raw(), flat.raw(), flat.nbytes());
  return out;
}

struct Want {
  std::vector<LowLatencyReceiver> layouts;
  std::vector<Tensor> recv_x, recv_scales, combined, expert_out;
};

Want oracle(const Case& cs, int R, std::uint64_t seed) {
  Want w;
  std::vector<LowLatencyInputs> in;
  std::vector<TensorView> indices, rows, scales;
  for (int r = 0; r < R; ++r) in.push_back(inputs_for(cs, R, r, seed));
  for (const LowLatencyInputs& li : in) {
    indices.push_back(li.in.indices);
    rows.push_back(li.x);
    if (cs.fp8) scales.push_back(li.scales);
  }
  const int E = cs.c.experts_per_rank * R;
  w.layouts = low_latency_layouts(indices, E, cs.max_tokens);
  std::vector<TensorView> outs;
  for (int d = 0; d < R; ++d) {
    const LowLatencyReceiver& lay = w.layouts[static_cast<std::size_t>(d)];
    w.recv_x.push_back(low_latency_recv_x(lay, rows, R, cs.max_tokens));
    if (cs.fp8) w.recv_scales.push_back(low_latency_recv_x(lay, scales, R, cs.max_tokens));
    w.expert_out.push_back(expert_outputs(cs, R, d, seed + 5));
  }
  for (const Tensor& t : w.expert_out) outs.push_back(t);
  for (int s = 0; s < R; ++s)
    w.combined.push_back(low_latency_combine_reference(w.layouts, s, in[static_cast<std::size_t>(s)].in.indices,
                                                       in[static_cast<std::size_t>(s)].in.weights, outs, E,
                                                       cs.max_tokens));
  return w;
}

// The first count rows of every expert's region of `got` equal `want`'s.
::testing::AssertionResult same_rows(const Tensor& want, const Tensor& got, const std::vector<std::int32_t>& count) {
  if (want.dtype() != got.dtype() || want.shape() != got.shape())
    return ::testing::AssertionFailure() << "shape or dtype differ: " << want.shape().str() << " vs " << got.shape().str();
  const std::int64_t region = want.size(1);
  const std::size_t row = static_cast<std::size_t>(want.size(2)) * element_size(want.dtype());
  for (std::size_t e = 0; e < count.size(); ++e)
    for (std::int64_t i = 0; i < count[e]; ++i) {
      const std::size_t at = (e * static_cast<std::size_t>(region) + static_cast<std::size_t>(i)) * row;
      if (std::memcmp(static_cast<const char*>(want.raw()) + at, static_cast<const char*>(got.raw()) + at, row) != 0)
        return ::testing::AssertionFailure() << "expert " << e << ", row " << i << " differs";
    }
  return ::testing::AssertionSuccess();
}

std::vector<std::int32_t> first_rows(const Tensor& src_info, const std::vector<std::int32_t>& count, std::int64_t region) {
  std::vector<std::int32_t> out;
  for (std::size_t e = 0; e < count.size(); ++e)
    for (std::int64_t i = 0; i < count[e]; ++i) out.push_back(src_info.data<std::int32_t>()[e * region + i]);
  return out;
}

void expect_matches(const Want& w, int d, const LowLatencyResult& res, const Tensor& combined, const Case& cs,
                    cudaStream_t stream) {
  const LowLatencyReceiver& lay = w.layouts[static_cast<std::size_t>(d)];
  const Tensor count = cuda::to_host(res.recv_count, stream);
  EXPECT_EQ(std::vector<std::int32_t>(count.data<std::int32_t>(), count.data<std::int32_t>() + count.numel()),
            lay.count)
      << "recv_count";
  const Tensor range = cuda::to_host(res.layout_range, stream);
  EXPECT_EQ(std::vector<std::int64_t>(range.data<std::int64_t>(), range.data<std::int64_t>() + range.numel()),
            lay.layout_range)
      << "layout_range";
  const std::int64_t region = res.recv_x.size(1);
  EXPECT_EQ(first_rows(cuda::to_host(res.recv_src_info, stream), lay.count, region),
            first_rows(Tensor::from_vector(lay.src_token, {static_cast<std::int64_t>(lay.src_token.size())}),
                       lay.count, region))
      << "recv_src_info";
  EXPECT_TRUE(same_rows(w.recv_x[static_cast<std::size_t>(d)], cuda::to_host(res.recv_x, stream), lay.count))
      << "recv_x";
  if (cs.fp8) {
    EXPECT_TRUE(same_rows(w.recv_scales[static_cast<std::size_t>(d)], cuda::to_host(res.recv_scales, stream), lay.count))
        << "recv_scales";
  }
  EXPECT_TRUE(same_bytes(w.combined[static_cast<std::size_t>(d)], cuda::to_host(combined, stream))) << "combine";
}

// Simulated ranks share one GPU: a host call that synchronises the device (a free, a pageable
// copy) on one rank would wait for another rank's kernel, which waits for this rank's next one.
// Each rank therefore makes its device inputs first, then all meet, then the calls run back to back.
void start_together(GpuRank& g) {
  if (simulated_ranks() == 0) return;
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(g.stream));
  g.comm->barrier("low-latency calls");
}

std::vector<Case> cases(int R) {
  std::vector<Case> cs = {
      {config("ll uniform k4 H256", 4, 4, 256, tokens_for(R, {37, 0}), RoutingKind::uniform), false, 64},
      {config("ll zipf k8 H7168", 8, 8, 7168, tokens_for(R, {128, 64}), RoutingKind::zipf), false, 128},
      {config("ll hot k1 H64", 2, 1, 64, tokens_for(R, {50, 50}), RoutingKind::hot), false, 50},
      {config("ll fp8 uniform k8 H1024", 4, 8, 1024, tokens_for(R, {33, 128}), RoutingKind::uniform), true, 128},
      {config("ll zipf k3 H128 i32", 3, 3, 128, tokens_for(R, {20, 7}), RoutingKind::zipf), false, 32},
  };
  cs.back().c.i32_indices = true;
  return cs;
}

}  // namespace

// Two rounds per case on one dispatcher (with a normal-mode dispatch between them): every
// output of both rounds is the oracle's.
TEST_P(DeepEpLowLatencyMultiGpu, MatchesTheCpuOracle) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  for (const Case& cs : cases(R)) {
    SCOPED_TRACE(cs.c.name);
    const int E = cs.c.experts_per_rank * R;
    const std::vector<Want> want = {oracle(cs, R, 11), oracle(cs, R, 12)};
    const auto errors = run_gpu_ranks(
        R,
        [&](GpuRank& g) {
          auto d = make_deepep_dispatcher(g.comm, E, options_for(cs, g.size, g.stream));
          for (std::size_t round = 0; round < want.size(); ++round) {
            SCOPED_TRACE("round " + std::to_string(round) + ", rank " + std::to_string(g.rank));
            const LowLatencyInputs li = inputs_for(cs, g.size, g.rank, 11 + round);
            const Tensor x = cuda::to_device(li.x, g.device, g.stream);
            const Tensor idx = cuda::to_device(li.in.indices, g.device, g.stream);
            const Tensor w = cuda::to_device(li.in.weights, g.device, g.stream);
            const Tensor sc = cs.fp8 ? cuda::to_device(li.scales, g.device, g.stream) : Tensor();
            const Tensor y = cuda::to_device(want[round].expert_out[static_cast<std::size_t>(g.rank)], g.device, g.stream);
            start_together(g);
            const LowLatencyResult res = d->low_latency_dispatch(x, idx, sc);
            const Tensor out = d->low_latency_combine(res.handle, y, idx, w);
            expect_matches(want[round], g.rank, res, out, cs, g.stream);
            d->check_errors();
            if (round == 0) {  // normal mode on the same dispatcher, between two low-latency rounds
              DispatchOptions rm;
              rm.layout = DispatchLayout::rank_major;
              DispatchResult n = d->dispatch(device_inputs(g, E, 8, cs.c.hidden, 1).view(), rm);
              d->combine(n.handle, n.tokens);
            }
          }
        },
        test_comm_options());
    ASSERT_TRUE(all_ok(errors));
  }
}

// A low-latency dispatch + combine captured once, replayed with new inputs: no host sync inside,
// every replay the oracle's.
TEST_P(DeepEpLowLatencyMultiGpu, DispatchAndCombineReplayInACudaGraph) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  Case cs{config("ll graph", 4, 4, 128, tokens_for(R, {48})), false, 48};
  const int E = cs.c.experts_per_rank * R, replays = 3;
  std::vector<Want> want;
  for (int rep = 0; rep < replays; ++rep) {
    cs.c.routing.kind = rep % 2 ? RoutingKind::zipf : RoutingKind::uniform;
    want.push_back(oracle(cs, R, 700 + static_cast<std::uint64_t>(rep)));
  }
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_deepep_dispatcher(g.comm, E, options_for(cs, g.size, g.stream));
        Case cr = cs;
        const LowLatencyInputs first = inputs_for(cr, g.size, g.rank, 1);
        const Tensor x = cuda::to_device(first.x, g.device, g.stream);
        const Tensor idx = cuda::to_device(first.in.indices, g.device, g.stream);
        const Tensor w = cuda::to_device(first.in.weights, g.device, g.stream);
        const Tensor y = cuda::to_device(want[0].expert_out[static_cast<std::size_t>(g.rank)], g.device, g.stream);
        start_together(g);
        LowLatencyResult warm = d->low_latency_dispatch(x, idx);  // loads the kernels outside the capture
        d->low_latency_combine(warm.handle, y, idx, w);
        d->check_errors();
        LowLatencyResult res;
        Tensor out;
        const cuda::CapturedGraph graph(g.stream, cudaStreamCaptureModeThreadLocal, [&] {
          res = d->low_latency_dispatch(x, idx);
          out = d->low_latency_combine(res.handle, y, idx, w);
        });
        for (int rep = 0; rep < replays; ++rep) {
          SCOPED_TRACE("replay " + std::to_string(rep) + ", rank " + std::to_string(g.rank));
          cr.c.routing.kind = rep % 2 ? RoutingKind::zipf : RoutingKind::uniform;
          const LowLatencyInputs li = inputs_for(cr, g.size, g.rank, 700 + static_cast<std::uint64_t>(rep));
          cuda::copy_async(x, li.x, g.stream);
          cuda::copy_async(idx, li.in.indices, g.stream);
          cuda::copy_async(w, li.in.weights, g.stream);
          cuda::copy_async(y, want[static_cast<std::size_t>(rep)].expert_out[static_cast<std::size_t>(g.rank)], g.stream);
          if (simulated_ranks() > 0) {
            FLEXEP_CUDA_CHECK(cudaStreamSynchronize(g.stream));
            g.comm->barrier("graph replay");
          }
          graph.launch(g.stream);
          expect_matches(want[static_cast<std::size_t>(rep)], g.rank, res, out, cr, g.stream);
        }
        d->check_errors();
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
}

// A bad id sends nothing and is raised by the next check_errors() of the rank that passed it; the
// other ranks' results are the oracle's for the routing without it, and the dispatcher stays usable.
// Arguments are checked by name before anything runs.
TEST_P(DeepEpLowLatencyMultiGpu, BadIdsAndArgumentsAreNamed) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  const Case cs{config("ll errors", 2, 2, 64, tokens_for(R, {16})), false, 16};
  const int E = cs.c.experts_per_rank * R;
  std::vector<std::exception_ptr> bad_id(static_cast<std::size_t>(R)), too_many(bad_id), no_buffers(bad_id),
      wrong_out(bad_id);
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_deepep_dispatcher(g.comm, E, options_for(cs, g.size, g.stream));
        const std::size_t r = static_cast<std::size_t>(g.rank);
        const LowLatencyInputs li = inputs_for(cs, g.size, g.rank, 3);
        Tensor ids = Tensor::empty(li.in.indices.shape(), DType::i64);
        std::memcpy(ids.raw(), li.in.indices.raw(), ids.nbytes());
        if (g.rank == 0) ids.data<std::int64_t>()[5 * 2] = E + 3;  // rank 0's token 5
        const Tensor x = cuda::to_device(li.x, g.device, g.stream);
        const Tensor idx = cuda::to_device(ids, g.device, g.stream);
        const Tensor good = cuda::to_device(li.in.indices, g.device, g.stream);
        const Tensor w = cuda::to_device(li.in.weights, g.device, g.stream);
        const Tensor y = Tensor::zeros({cs.c.experts_per_rank, g.size * cs.max_tokens, cs.c.hidden}, DType::bf16,
                                       Device::cuda(g.device));
        start_together(g);
        const LowLatencyResult res = d->low_latency_dispatch(x, idx);
        d->low_latency_combine(res.handle, y, idx, w);
        try {
          d->check_errors();
        } catch (...) {
          bad_id[r] = std::current_exception();
        }
        try {
          const Tensor big = cuda::to_device(random_tensor({17, cs.c.hidden}, DType::bf16, 1, "x", g.rank), g.device,
                                             g.stream);
          d->low_latency_dispatch(big, cuda::to_device(synthetic_topk(17, 2, E, RoutingSpec{}, 1, g.rank).indices,
                                                       g.device, g.stream));
        } catch (...) {
          too_many[r] = std::current_exception();
        }
        try {
          const Tensor bad = Tensor::zeros({1, 8, cs.c.hidden}, DType::bf16, Device::cuda(g.device));
          d->low_latency_combine(res.handle, bad, idx, w);
        } catch (...) {
          wrong_out[r] = std::current_exception();
        }
        DeepEpOptions plain = options_for(cs, g.size, g.stream);
        plain.low_latency_max_tokens = 0;
        auto n = make_deepep_dispatcher(g.comm, E, plain);
        try {
          n->low_latency_dispatch(x, idx);
        } catch (...) {
          no_buffers[r] = std::current_exception();
        }
        // Still usable: a clean round.
        start_together(g);
        const LowLatencyResult ok = d->low_latency_dispatch(x, good);
        d->low_latency_combine(ok.handle, y, good, w);
        d->check_errors();
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  ASSERT_TRUE(bad_id[0] != nullptr);
  EXPECT_TRUE(contains(what_of(bad_id[0]), "'indices'")) << what_of(bad_id[0]);
  for (int r = 1; r < R; ++r) EXPECT_TRUE(bad_id[static_cast<std::size_t>(r)] == nullptr) << "rank " << r;
  EXPECT_TRUE(all_threw<ArgumentError>(too_many, argument_is("x", [](const std::string& m) {
    return contains(m, "low_latency_max_tokens");
  })));
  EXPECT_TRUE(all_threw<ArgumentError>(wrong_out, argument_is("expert_out", [](const std::string&) { return true; })));
  EXPECT_TRUE(all_threw<ArgumentError>(no_buffers, argument_is("options.low_latency_max_tokens",
                                                               [](const std::string&) { return true; })));
}

TEST_P(DeepEpLowLatencyMultiGpu, MissingPeerTimesOutNamingPhaseAndPeer) {
  if (!require_ranks()) return;
  const int R = gpu_ranks();
  Case cs{config("ll timeout", 2, 2, 64, tokens_for(R, {16})), false, 16};
  const int E = cs.c.experts_per_rank * R;
  std::atomic<int> finished{0};
  // The live ranks start their dispatches together: one that is merely late (its host thread
  // starved while the others' kernels wait) would be named instead of the missing one.
  std::latch live(R - 1);
  std::vector<std::exception_ptr> failures(static_cast<std::size_t>(R));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        DeepEpOptions o = options_for(cs, g.size, g.stream);
        o.timeout_seconds = 3;
        auto d = make_deepep_dispatcher(g.comm, E, o);
        if (g.rank == 1) {  // silent until the others gave up
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
          while (finished.load() < g.size - 1 && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          return;
        }
        const LowLatencyInputs li = inputs_for(cs, g.size, g.rank, 3);
        const Tensor x = cuda::to_device(li.x, g.device, g.stream);
        const Tensor idx = cuda::to_device(li.in.indices, g.device, g.stream);
        FLEXEP_CUDA_CHECK(cudaStreamSynchronize(g.stream));
        live.arrive_and_wait();
        try {
          d->low_latency_dispatch(x, idx);
          d->check_errors();
        } catch (...) {
          failures[static_cast<std::size_t>(g.rank)] = std::current_exception();
        }
        ++finished;
      },
      test_comm_options());
  ASSERT_TRUE(all_ok(errors));
  expect_timeouts(failures, 1, "deepep low_latency_dispatch:rows");
}

}  // namespace flexep::testing
