// plan_local on the device against core/plan.h with R = 1 (DispatchPlan::build + slot_rows) on the
// same indices: every layout field and every slot's row must be identical.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "flexep/core/error.h"
#include "flexep/cuda/local_plan.h"
#include "gpu/local_plan_test_util.h"

namespace flexep::testing {
namespace {

using cuda::DeviceErrors;
using cuda::LocalPlan;

// Plans `r` on the device (storage poisoned first) and compares with the CPU plan.
void check_plan(const Routed& r, const PlanParams& params, cudaStream_t stream) {
  const RefPlan ref = reference_plan(r.indices, params);
  const Tensor idx = cuda::to_device(r.indices, 0, stream);
  DeviceErrors errors(0);
  LocalPlan plan = cuda::make_local_plan(idx.size(0), idx.size(1), params, 0, stream);
  poison_plan(plan, stream);
  cuda::plan_local_into(plan, idx, errors, stream);
  errors.check(stream, "test");
  expect_plan_eq(plan, ref, stream);
}

TEST(LocalPlan, BlockingMatchesCpuPlanAcrossRoutingsAndSizes) {
  if (!require_gpus(1)) return;
  TestStream stream;
  std::uint64_t seed = 1;
  for (Routing kind : {Routing::uniform, Routing::zipf, Routing::one_expert})
    for (int E : {1, 8, 64, 256})
      for (int k : {1, 2, 8})
        for (std::int64_t pad : {1, 16, 128})
          for (std::int64_t T : {0, 1, 37, 4096}) {
            const DType index_dtype = (seed % 2) ? DType::i32 : DType::i64;
            SCOPED_TRACE(std::string(routing_name(kind)) + " E=" + std::to_string(E) + " k=" + std::to_string(k) +
                         " pad=" + std::to_string(pad) + " T=" + std::to_string(T) + " " +
                         std::string(dtype_name(index_dtype)));
            const Routed r = make_routing(T, k, E, kind, index_dtype, 0.15, seed++);
            check_plan(r, local_params(E, pad), stream);
          }
}

TEST(LocalPlan, TokensWithoutExpertsAndEmptyExperts) {
  if (!require_gpus(1)) return;
  TestStream stream;
  // Every slot -1: no rows at all.
  Routed none = make_routing(33, 4, 16, Routing::uniform, DType::i64, 1.0, 3);
  check_plan(none, local_params(16, 16), stream);
  // Half the slots -1 and only 3 of 64 experts used: most groups empty, padded groups in between.
  Routed sparse = make_routing(101, 2, 3, Routing::uniform, DType::i32, 0.5, 4);
  check_plan(sparse, local_params(64, 16), stream);
}

TEST(LocalPlan, BudgetModeExactFitAndSlack) {
  if (!require_gpus(1)) return;
  TestStream stream;
  const int E = 64;
  for (Routing kind : {Routing::uniform, Routing::zipf}) {
    const Routed r = make_routing(1000, 8, E, kind, DType::i64, 0.1, 11);
    const std::int64_t required = reference_plan(r.indices, local_params(E, 16)).layout().required_rows;
    for (std::int64_t budget : {required, required + 16 * 7}) {
      SCOPED_TRACE(std::string(routing_name(kind)) + " budget " + std::to_string(budget) + " of " +
                   std::to_string(required));
      check_plan(r, local_params(E, 16, budget), stream);
    }
  }
}

TEST(LocalPlan, BudgetModeDoesNotSynchronise) {
  if (!require_gpus(1)) return;
  TestStream stream;
  const Routed r = make_routing(512, 8, 64, Routing::uniform, DType::i64, 0.0, 5);
  const Tensor idx = cuda::to_device(r.indices, 0, stream);
  DeviceErrors errors(0);
  LocalPlan plan = cuda::make_local_plan(512, 8, local_params(64, 16, 8192), 0, stream);
  // Warm up: the first launch of a kernel loads its module (CUDA's lazy loading), which may wait for
  // the device; that is the runtime's one-time cost, not a synchronisation of plan_local_into.
  cuda::plan_local_into(plan, idx, errors, stream);
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  // Hold the stream behind a host-side gate: a plan_local_into that waited for the device could
  // only return after the gate gave up (10 s), so returning while it is still shut shows that it only
  // enqueues (and out_rows is known without the device).
  // (static: it must outlive the callback even if the test throws)
  struct Gate {
    std::atomic<bool> open{false};
    std::atomic<bool> gave_up{false};
  };
  static Gate gate;
  gate.open = false;
  gate.gave_up = false;
  FLEXEP_CUDA_CHECK(cudaLaunchHostFunc(
      stream.get(),
      [](void* p) {
        auto* g = static_cast<Gate*>(p);
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!g->open.load()) {
          if (std::chrono::steady_clock::now() > deadline) {
            g->gave_up = true;
            return;
          }
          std::this_thread::yield();
        }
      },
      &gate));
  cuda::plan_local_into(plan, idx, errors, stream);
  EXPECT_FALSE(gate.gave_up.load()) << "plan_local_into waited for the stream in budget mode";
  EXPECT_EQ(plan.out_rows, 8192);
  EXPECT_FALSE(plan.host_tokens_per_expert.defined());
  gate.open = true;
  errors.check(stream, "test");
  expect_plan_eq(plan, reference_plan(r.indices, local_params(64, 16, 8192)), stream);
}

TEST(LocalPlan, BudgetOverflowIsReportedAsBudgetRowsAndStaysInBounds) {
  if (!require_gpus(1)) return;
  TestStream stream;
  const int E = 8;
  const Routed r = make_routing(300, 2, E, Routing::zipf, DType::i64, 0.0, 21);
  const std::int64_t required = reference_plan(r.indices, local_params(E, 16)).layout().required_rows;
  const std::int64_t budget = required / 2 / 16 * 16;
  const Tensor idx = cuda::to_device(r.indices, 0, stream);
  DeviceErrors errors(0);
  LocalPlan plan = cuda::make_local_plan(300, 2, local_params(E, 16, budget), 0, stream);
  poison_plan(plan, stream);
  cuda::plan_local_into(plan, idx, errors, stream);  // no throw: nothing is known on the host yet
  try {
    errors.check(stream, "dispatch");
    ADD_FAILURE() << "overflow not reported";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "budget_rows");
    const std::string w = e.what();
    EXPECT_NE(w.find(std::to_string(required) + " expert-major rows are needed"), std::string::npos) << w;
    EXPECT_NE(w.find("budget_rows is " + std::to_string(budget)), std::string::npos) << w;
  }
  errors.check(stream, "dispatch");  // the record was cleared
  // What was written is the drop layout: nothing at or past the budget.
  expect_plan_eq(plan, reference_plan(r.indices, local_params(E, 16, budget, OverflowPolicy::drop)), stream);
}

TEST(LocalPlan, DropPolicyKeepsThePrefixAndCountsDrops) {
  if (!require_gpus(1)) return;
  TestStream stream;
  for (int E : {8, 64})
    for (std::int64_t pad : {1, 16}) {
      const Routed r = make_routing(777, 4, E, Routing::zipf, DType::i32, 0.05, 31 + E);
      const std::int64_t required = reference_plan(r.indices, local_params(E, pad)).layout().required_rows;
      for (std::int64_t budget : {std::int64_t{0}, pad, required / 3 / pad * pad, required - pad}) {
        SCOPED_TRACE("E=" + std::to_string(E) + " pad=" + std::to_string(pad) + " budget " + std::to_string(budget) +
                     " of " + std::to_string(required));
        const PlanParams p = local_params(E, pad, budget, OverflowPolicy::drop);
        ASSERT_GT(reference_plan(r.indices, p).layout().dropped, 0);
        check_plan(r, p, stream);  // includes errors.check: drops are not errors
      }
    }
}

TEST(LocalPlan, OutOfRangeIdIsReportedWithItsPositionAndTreatedAsNone) {
  if (!require_gpus(1)) return;
  TestStream stream;
  const int E = 16;
  for (DType dt : {DType::i32, DType::i64})
    for (std::int64_t bad : {std::int64_t{E}, std::int64_t{-2}, std::int64_t{1000}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " id " + std::to_string(bad));
      Routed r = make_routing(50, 4, E, Routing::uniform, DType::i64, 0.1, 41);
      r.indices.data<std::int64_t>()[7 * 4 + 2] = bad;
      Routed clean = r;
      clean.indices = r.indices.clone();
      clean.indices.data<std::int64_t>()[7 * 4 + 2] = -1;
      const Tensor idx = cuda::to_device(dt == DType::i64 ? r.indices : r.indices.to(DType::i32), 0, stream);
      DeviceErrors errors(0);

      // Budget mode: reported at the next check; the layout is that of the id read as -1.
      const PlanParams budget = local_params(E, 16, 1024);
      LocalPlan plan = cuda::make_local_plan(50, 4, budget, 0, stream);
      poison_plan(plan, stream);
      cuda::plan_local_into(plan, idx, errors, stream);
      try {
        errors.check(stream, "dispatch");
        ADD_FAILURE() << "bad id not reported";
      } catch (const ArgumentError& e) {
        EXPECT_EQ(e.argument(), "indices");
        const std::string w = e.what();
        EXPECT_NE(w.find("value " + std::to_string(bad) + " at [7, 2]"), std::string::npos) << w;
        EXPECT_NE(w.find("< " + std::to_string(E)), std::string::npos) << w;
      }
      expect_plan_eq(plan, reference_plan(clean.indices, budget), stream);

      // Blocking mode: plan_local throws it itself (it synchronises anyway).
      try {
        cuda::plan_local(idx, local_params(E, 16), errors, stream);
        ADD_FAILURE() << "bad id not reported";
      } catch (const ArgumentError& e) {
        EXPECT_EQ(e.argument(), "indices");
        EXPECT_NE(std::string(e.what()).find("[7, 2]"), std::string::npos) << e.what();
      }
      // The device is fine afterwards.
      const Tensor good = cuda::to_device(clean.indices, 0, stream);
      LocalPlan again = cuda::plan_local(good, local_params(E, 16), errors, stream);
      expect_plan_eq(again, reference_plan(clean.indices, local_params(E, 16)), stream);
    }
}

TEST(LocalPlan, HugeInt64IdIsNotTruncatedIntoRange) {
  if (!require_gpus(1)) return;
  TestStream stream;
  Routed r = make_routing(10, 2, 8, Routing::uniform, DType::i64, 0.0, 43);
  const std::int64_t bad = (std::int64_t{1} << 32) + 3;  // would be expert 3 if cut to 32 bits
  r.indices.data<std::int64_t>()[5 * 2 + 1] = bad;
  const Tensor idx = cuda::to_device(r.indices, 0, stream);
  DeviceErrors errors(0);
  try {
    cuda::plan_local(idx, local_params(8, 1), errors, stream);
    ADD_FAILURE() << "bad id not reported";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("value " + std::to_string(bad) + " at [5, 1]"), std::string::npos)
        << e.what();
  }
}

TEST(LocalPlan, RepeatedExpertInATokenIsReported) {
  if (!require_gpus(1)) return;
  TestStream stream;
  Routed r = make_routing(20, 4, 16, Routing::uniform, DType::i64, 0.0, 47);
  std::int64_t* id = r.indices.data<std::int64_t>();
  id[9 * 4 + 3] = id[9 * 4 + 1];
  const Tensor idx = cuda::to_device(r.indices, 0, stream);
  DeviceErrors errors(0);
  try {
    cuda::plan_local(idx, local_params(16, 1), errors, stream);
    ADD_FAILURE() << "repeated expert not reported";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "indices");
    EXPECT_NE(std::string(e.what()).find("token 9 lists expert " + std::to_string(id[9 * 4 + 1]) + " twice"),
              std::string::npos)
        << e.what();
  }
}

TEST(LocalPlan, ReplanningReusesTheStorage) {
  if (!require_gpus(1)) return;
  TestStream stream;
  const PlanParams p = local_params(32, 16);
  LocalPlan plan = cuda::make_local_plan(257, 2, p, 0, stream);
  const void* slot_storage = plan.slot_rows.raw();
  DeviceErrors errors(0);
  for (std::uint64_t seed = 0; seed < 4; ++seed) {
    const Routed r = make_routing(257, 2, 32, seed % 2 ? Routing::zipf : Routing::uniform, DType::i64, 0.2, 50 + seed);
    const Tensor idx = cuda::to_device(r.indices, 0, stream);
    cuda::plan_local_into(plan, idx, errors, stream);
    expect_plan_eq(plan, reference_plan(r.indices, p), stream);
  }
  EXPECT_EQ(plan.slot_rows.raw(), slot_storage);
}

TEST(LocalPlan, ArgumentsAreCheckedBeforeAnyWork) {
  if (!require_gpus(1)) return;
  TestStream stream;
  DeviceErrors errors(0);
  const Routed r = make_routing(4, 2, 8, Routing::uniform, DType::i64, 0.0, 60);
  const Tensor idx = cuda::to_device(r.indices, 0, stream);
  auto arg_of = [&](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const ArgumentError& e) {
      return e.argument();
    }
    return "(nothing thrown)";
  };
  PlanParams two_ranks = local_params(8, 1);
  two_ranks.ranks = 2;
  EXPECT_EQ(arg_of([&] { cuda::plan_local(idx, two_ranks, errors, stream); }), "ranks");
  EXPECT_EQ(arg_of([&] { cuda::plan_local(r.indices, local_params(8, 1), errors, stream); }), "indices");  // on the CPU
  EXPECT_EQ(arg_of([&] { cuda::plan_local(idx, local_params(8, 0), errors, stream); }), "pad_multiple");
  EXPECT_EQ(arg_of([&] { cuda::plan_local(idx, local_params(8, 16, 20), errors, stream); }), "budget_rows");
  const Tensor f32_idx = cuda::to_device(r.weights, 0, stream);
  EXPECT_EQ(arg_of([&] { cuda::plan_local(f32_idx, local_params(8, 1), errors, stream); }), "indices");
  LocalPlan plan = cuda::make_local_plan(5, 2, local_params(8, 1), 0, stream);
  EXPECT_EQ(arg_of([&] { cuda::plan_local_into(plan, idx, errors, stream); }), "indices");  // 4 tokens, not 5
  EXPECT_EQ(arg_of([&] { cuda::make_local_plan(4, 0, local_params(8, 1), 0, stream); }), "topk");
}

}  // namespace
}  // namespace flexep::testing
