// The alltoall backend on R = min(GPUs, 4) ranks (one thread per GPU) against the host backend on
// R simulated ranks, for the same inputs: dispatch (tokens, probs, tokens_per_expert, dropped),
// combine, combine_backward and dispatch_backward are all compared bit for bit. Also: budget mode
// (exact size, drop, overflow error), the multihot form, the separate communication stream, errors
// raised on every rank (configuration mismatch, bad ids, bad arguments in dispatch, combine and the
// backwards) and a missing peer turning into a TimeoutError that names the phase.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "flexep/comm/host_world.h"
#include "flexep/core/random.h"
#include "flexep/core/routing.h"
#include "flexep/core/synthetic_routing.h"
#include "flexep/dispatch/alltoall.h"
#include "flexep/dispatch/host.h"
#include "gpu/dispatch_harness.h"
#include "gpu/gpu_test_util.h"
#include "gpu/multi_gpu.h"

namespace flexep::testing {
namespace {

// ---- the alltoall backend on one GPU rank ------------------------------------------------------------

Outputs run_gpu_rank(GpuRank& g, const Config& c) {
  AlltoallOptions ao;
  ao.separate_stream = c.separate_stream;
  auto d = make_alltoall_dispatcher(g.comm, c.experts_per_rank * g.size, ao);
  auto up = [&](const Tensor& t) { return cuda::to_device(t, g.device, g.stream); };
  auto down = [&](const Tensor& t) { return t.device().is_cpu() ? t : cuda::to_host(t, g.stream); };
  auto dropped = [](const DispatchResult& r) { return r.dropped; };
  return run_sequence(*d, make_inputs(c, g.size, g.rank), c, dispatch_options(c, g.size), g.rank, up, down, dropped);
}

void check_against_host(const std::vector<Config>& configs) { ::flexep::testing::check_against_host(configs, run_gpu_rank); }

TEST(AlltoallMultiGpu, MatchesHostUniform) {
  if (!require_gpus(2)) return;
  Config i32 = config("uniform E=16R k=8 H=8 i32 ids", 16, 8, 8, {64, 100, 3, 0});
  i32.i32_indices = true;
  check_against_host({
      config("uniform E=2R k=1 H=8 pad 1", 2, 1, 8, {37, 0, 53, 11}),
      config("uniform E=2R k=1 H=8 pad 128", 2, 1, 8, {37, 0, 53, 11}, RoutingKind::uniform, 128),
      config("uniform E=16R k=8 H=8 pad 128", 16, 8, 8, {300, 257, 0, 129}, RoutingKind::uniform, 128),
      config("uniform E=16R k=8 H=7168 pad 1", 16, 8, 7168, {2048, 0, 1000, 77}),
      config("uniform E=2R k=1 H=7168 pad 128", 2, 1, 7168, {0, 513, 64, 2048}, RoutingKind::uniform, 128),
      i32,
  });
}

TEST(AlltoallMultiGpu, MatchesHostZipf) {
  if (!require_gpus(2)) return;
  check_against_host({
      config("zipf E=16R k=8 H=7168 pad 1", 16, 8, 7168, {2048, 1024, 0, 512}, RoutingKind::zipf),
      config("zipf E=16R k=8 H=8 pad 128", 16, 8, 8, {500, 0, 333, 64}, RoutingKind::zipf, 128),
      config("zipf E=2R k=1 H=8 pad 1", 2, 1, 8, {0, 200, 17, 5}, RoutingKind::zipf),
  });
}

TEST(AlltoallMultiGpu, MatchesHostAllToOneExpert) {
  if (!require_gpus(2)) return;
  check_against_host({
      config("hot k=1 E=2R H=8", 2, 1, 8, {100, 0, 31, 7}, RoutingKind::hot),
      config("hot k=1 E=16R H=7168 pad 128", 16, 1, 7168, {1024, 2048, 0, 300}, RoutingKind::hot, 128),
      config("hot k=8 E=16R H=8", 16, 8, 8, {100, 64, 0, 9}, RoutingKind::hot),
  });
}

TEST(AlltoallMultiGpu, MultihotGivesTheSameRowsAsTopK) {
  if (!require_gpus(2)) return;
  const int R = gpu_ranks();
  Config topk = config("zipf E=16R k=8 H=8 pad 16", 16, 8, 8, {200, 0, 77, 31}, RoutingKind::zipf, 16);
  Config mh = topk;
  mh.name += " multihot";
  mh.multihot = true;
  const std::vector<Outputs> want_topk = run_host(topk, R), want_mh = run_host(mh, R);
  std::vector<Outputs> got_topk(static_cast<std::size_t>(R)), got_mh(static_cast<std::size_t>(R));
  const auto errors = run_gpu_ranks(R, [&](GpuRank& g) {
    got_topk[static_cast<std::size_t>(g.rank)] = run_gpu_rank(g, topk);
    got_mh[static_cast<std::size_t>(g.rank)] = run_gpu_rank(g, mh);
  });
  ASSERT_TRUE(all_ok(errors));
  expect_equal(want_topk, got_topk, topk.name);
  expect_equal(want_mh, got_mh, mh.name);  // weight grads here are [T, E]
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const auto i = static_cast<std::size_t>(r);
    EXPECT_TRUE(same_bytes(got_topk[i].tokens, got_mh[i].tokens));
    EXPECT_TRUE(same_bytes(got_topk[i].probs, got_mh[i].probs));
    EXPECT_TRUE(same_bytes(got_topk[i].tokens_per_expert, got_mh[i].tokens_per_expert));
    EXPECT_TRUE(same_bytes(got_topk[i].combined, got_mh[i].combined));
    EXPECT_EQ(got_mh[i].grad_weights.size(1), 16 * R);
  }
}

TEST(AlltoallMultiGpu, SeparateStreamMatchesHost) {
  if (!require_gpus(2)) return;
  Config a = config("separate stream zipf E=16R k=8 H=7168", 16, 8, 7168, {1024, 512, 0, 100}, RoutingKind::zipf);
  a.separate_stream = true;
  Config b = config("separate stream budget drop", 2, 1, 8, {300, 0, 45, 7}, RoutingKind::hot, 16);
  b.separate_stream = true;
  b.mode = DispatchMode::budget;
  b.budget_fraction = 0.5;
  b.overflow = OverflowPolicy::drop;
  check_against_host({a, b});
}

TEST(AlltoallMultiGpu, BudgetModeMatchesHost) {
  if (!require_gpus(2)) return;
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

  const DispatchOptions o = dispatch_options(exact, R);
  std::int64_t most = 0;
  for (std::int64_t n : required_rows(exact, R)) most = std::max(most, n);
  EXPECT_EQ(o.budget_rows, most);
  // The drop cases really drop (on the host, and the GPU matched the counts above).
  std::int64_t dropped = 0;
  for (const Outputs& o2 : run_host(drop, R)) dropped += o2.dropped;
  EXPECT_GT(dropped, 0);
}

TEST(AlltoallMultiGpu, BudgetOverflowRaisesOnEveryRank) {
  if (!require_gpus(2)) return;
  const int R = gpu_ranks();
  Config c = config("budget overflow", 16, 8, 8, {300, 100, 0, 64}, RoutingKind::zipf, 16);
  c.mode = DispatchMode::budget;
  c.budget_fraction = 0.5;
  c.overflow = OverflowPolicy::error;
  auto overflow = [](const Error& e) { return std::string(e.what()).find("overflow") != std::string::npos; };
  auto host_world = std::make_shared<HostWorld>(R, 60.0);
  EXPECT_TRUE(all_threw<Error>(run_ranks(R,
                                         [&](int r) {
                                           auto d = make_host_dispatcher(host_world, r, 16 * R);
                                           const Inputs in = make_inputs(c, R, r);
                                           DispatchInput di;
                                           di.hidden = in.hidden;
                                           di.indices = in.indices;
                                           di.weights = in.weights;
                                           d->dispatch(di, dispatch_options(c, R));
                                         }),
                               overflow));
  const auto errors = run_gpu_ranks(R, [&](GpuRank& g) {
    auto d = make_alltoall_dispatcher(g.comm, 16 * R);
    const Inputs in = make_inputs(c, R, g.rank);
    const DeviceInputs dev = to_device(in, g);
    const DispatchInput di = dev.view();
    d->dispatch(di, dispatch_options(c, R));
  });
  EXPECT_TRUE(all_threw<Error>(errors, overflow));
}

// ---- errors raised on every rank ---------------------------------------------------------------------

TEST(AlltoallMultiGpu, ConfigMismatchRaisesOnEveryRank) {
  if (!require_gpus(2)) return;
  const int R = gpu_ranks(), E = 4 * R;
  std::vector<std::exception_ptr> mismatch_h(static_cast<std::size_t>(R)), mismatch_k(mismatch_h);
  const auto errors = run_gpu_ranks(R, [&](GpuRank& g) {
    auto d = make_alltoall_dispatcher(g.comm, E);
    const std::size_t r = static_cast<std::size_t>(g.rank);
    try {  // rank 1 passes H = 16, the others H = 8
      d->dispatch(device_inputs(g, E, 20, g.rank == 1 ? 16 : 8, 2).view(), {});
    } catch (...) {
      mismatch_h[r] = std::current_exception();
    }
    try {  // rank 1 routes to top-3, the others to top-2
      d->dispatch(device_inputs(g, E, 20, 8, g.rank == 1 ? 3 : 2).view(), {});
    } catch (...) {
      mismatch_k[r] = std::current_exception();
    }
    // The communicator is still in step: a correct call works.
    d->dispatch(device_inputs(g, E, 20, 8, 2).view(), {});
  });
  ASSERT_TRUE(all_ok(errors));
  EXPECT_TRUE(all_threw<ArgumentError>(mismatch_h, argument_is("hidden", [](const std::string& w) {
    return contains(w, "rank 1 has H=16 but rank 0 has H=8");
  })));
  EXPECT_TRUE(all_threw<ArgumentError>(mismatch_k, argument_is("indices", [](const std::string& w) {
    return contains(w, "rank 1 has k=3 but rank 0 has k=2");
  })));
}

TEST(AlltoallMultiGpu, NumExpertsMismatchRaisesOnEveryRank) {
  if (!require_gpus(2)) return;
  const int R = gpu_ranks();
  const auto errors = run_gpu_ranks(R, [&](GpuRank& g) {
    const int E = g.rank == 1 ? 4 * R : 2 * R;
    auto d = make_alltoall_dispatcher(g.comm, E);
    d->dispatch(device_inputs(g, E, 10, 8, 1).view(), {});
  });
  EXPECT_TRUE(all_threw<ArgumentError>(errors, argument_is("num_experts", [&](const std::string& w) {
    return contains(w, "rank 1 has E=" + std::to_string(4 * R) + " but rank 0 has E=" + std::to_string(2 * R));
  })));
}

TEST(AlltoallMultiGpu, BadIdsAndBadArgumentsRaiseOnEveryRank) {
  if (!require_gpus(2)) return;
  const int R = gpu_ranks(), E = 2 * R;
  std::vector<std::exception_ptr> bad_id(static_cast<std::size_t>(R)), repeated(bad_id), bad_dtype(bad_id),
      rank_major(bad_id);
  const auto errors = run_gpu_ranks(R, [&](GpuRank& g) {
    auto d = make_alltoall_dispatcher(g.comm, E);
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
    try {  // every rank asks for DeepEP's layout, which alltoall does not write
      DispatchOptions o;
      o.layout = DispatchLayout::rank_major;
      d->dispatch(device_inputs(g, E, 6, 8, 2).view(), o);
    } catch (...) {
      rank_major[r] = std::current_exception();
    }
    d->dispatch(device_inputs(g, E, 6, 8, 2).view(), {});  // the error records were cleared
  });
  ASSERT_TRUE(all_ok(errors));
  const std::string last = std::to_string(R - 1);
  EXPECT_TRUE(all_threw<ArgumentError>(bad_id, argument_is("indices", [&](const std::string& w) {
    return contains(w, "value " + std::to_string(E) + " at [2, 1] is out of range");
  })));
  EXPECT_TRUE(all_threw<ArgumentError>(repeated, argument_is("indices", [](const std::string& w) {
    return contains(w, "token 4 lists expert 1 twice");
  })));
  EXPECT_TRUE(all_threw<ArgumentError>(bad_dtype, argument_is("weights", [](const std::string&) { return true; })));
  EXPECT_TRUE(all_threw<ArgumentError>(rank_major, argument_is("options.layout", [](const std::string& w) {
    return contains(w, "the alltoall backend does not write");
  })));
  for (int r = 0; r < R; ++r) {
    if (r == 1) continue;
    EXPECT_TRUE(contains(what_of(bad_dtype[static_cast<std::size_t>(r)]), "rank 1 failed its checks"));
  }
}

// combine and the backwards: one rank's bad argument is raised on every rank (the verdicts go round
// before any row moves); the dispatcher stays usable and its next combine gives the same bits.
TEST(AlltoallMultiGpu, ErrorsInCombineAndBackwardsReachEveryRank) {
  if (!require_gpus(2)) return;
  const int R = gpu_ranks(), E = 2 * R;
  const std::int64_t T = 6, H = 8;
  std::vector<std::exception_ptr> combine(static_cast<std::size_t>(R)), grads(combine), rows(combine), handle(combine);
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_alltoall_dispatcher(g.comm, E);
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
      EXPECT_TRUE(contains(what_of(combine[at]), "rank " + std::to_string(last) + " failed its checks in combine"))
          << what_of(combine[at]);
      EXPECT_TRUE(contains(what_of(rows[at]), "rank " + std::to_string(last) + " failed its checks in combine_backward"))
          << what_of(rows[at]);
    }
    if (r != 0) {
      EXPECT_TRUE(contains(what_of(grads[at]), "rank 0 failed its checks in dispatch_backward")) << what_of(grads[at]);
      EXPECT_TRUE(contains(what_of(handle[at]), "rank 0 failed its checks in combine")) << what_of(handle[at]);
    }
  }
}

// ---- a rank that stops participating --------------------------------------------------------------------

// Rank 1 skips `phase_call` (0: the second dispatch, 1: a combine); the others must fail with a
// TimeoutError naming `phase` within the 3 s timeout (plus slack for the abort).
void check_missing_peer(int skipped_call, const std::string& phase) {
  const int R = gpu_ranks(), E = 2 * R;
  CommunicatorOptions co;
  co.timeout_seconds = 3;
  std::atomic<int> finished{0};
  std::vector<double> seconds(static_cast<std::size_t>(R), 0.0);
  std::vector<std::exception_ptr> failures(static_cast<std::size_t>(R));
  const auto errors = run_gpu_ranks(
      R,
      [&](GpuRank& g) {
        auto d = make_alltoall_dispatcher(g.comm, E);
        const DeviceInputs in = device_inputs(g, E, 16, 8, 1);
        DispatchResult res = d->dispatch(in.view(), {});  // all ranks: works
        if (g.rank == 1) {
          // Stay alive (and silent) until the others gave up, so they time out rather than see a
          // closed peer.
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
          while (finished.load() < g.size - 1 && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          if (skipped_call == 0) {
            d->dispatch(in.view(), {});
          } else {
            const Tensor rows = cuda::to_device(random_tensor({res.tokens.size(0), 8}, DType::bf16, 2, "x", g.rank),
                                                g.device, g.stream);
            d->combine(res.handle, rows);
          }
        } catch (...) {
          failures[static_cast<std::size_t>(g.rank)] = std::current_exception();
        }
        seconds[static_cast<std::size_t>(g.rank)] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        ++finished;
      },
      co);
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
    } catch (...) {
      ADD_FAILURE() << "not a TimeoutError: " << what_of(e);
    }
    EXPECT_GE(seconds[static_cast<std::size_t>(r)], 2.5);
    EXPECT_LT(seconds[static_cast<std::size_t>(r)], 30.0);
  }
}

TEST(AlltoallMultiGpu, MissingPeerInDispatchTimesOutNamingThePhase) {
  if (!require_gpus(2)) return;
  check_missing_peer(0, "dispatch:count-exchange");
}

TEST(AlltoallMultiGpu, MissingPeerInCombineTimesOutNamingThePhase) {
  if (!require_gpus(2)) return;
  check_missing_peer(1, "combine:checks");  // the verdicts go round before the partials
}

}  // namespace
}  // namespace flexep::testing
