// permute / unpermute / gather_slot_values on the device against the CPU: core permute on the same
// plan (bitwise: tokens and probs are copies), unpermute against the fp32 sum in ascending expert id
// rounded once (written out here, and also core unpermute), the host dispatcher with one rank, and
// replays of a captured CUDA graph.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flexep/comm/host_world.h"
#include "flexep/core/error.h"
#include "flexep/cuda/graph.h"
#include "flexep/cuda/local_plan.h"
#include "flexep/cuda/permute.h"
#include "flexep/dispatch/host.h"
#include "gpu/local_plan_test_util.h"

namespace flexep::testing {
namespace {

using cuda::DeviceErrors;
using cuda::LocalPlan;

constexpr int kPoison = 0xA5;

Tensor device_empty(Shape s, DType dt) { return Tensor::empty(s, dt, Device::cuda(0)); }

std::int64_t index_at(const Tensor& idx, std::int64_t i) {
  return idx.dtype() == DType::i32 ? idx.data<std::int32_t>()[i] : idx.data<std::int64_t>()[i];
}

// out[t] = sum of token t's kept rows in ascending expert id, accumulated in fp32 from 0, rounded
// once to out_dtype: the contract, written independently of core/plan.cpp.
Tensor reference_unpermute(const Tensor& rows, const Tensor& indices, const std::vector<std::int64_t>& slot,
                           DType out_dtype) {
  const std::int64_t T = indices.size(0), k = indices.size(1), H = rows.size(1);
  Tensor out = Tensor::empty({T, H}, out_dtype);
  std::vector<float> acc(static_cast<std::size_t>(H));
  std::vector<std::pair<std::int64_t, std::int64_t>> order;  // (expert, row)
  for (std::int64_t t = 0; t < T; ++t) {
    order.clear();
    for (std::int64_t j = 0; j < k; ++j)
      if (slot[static_cast<std::size_t>(t * k + j)] >= 0)
        order.emplace_back(index_at(indices, t * k + j), slot[static_cast<std::size_t>(t * k + j)]);
    std::sort(order.begin(), order.end());
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (const auto& [expert, row] : order)
      for (std::int64_t h = 0; h < H; ++h)
        acc[static_cast<std::size_t>(h)] += static_cast<float>(read_as_double(rows, row * H + h));
    for (std::int64_t h = 0; h < H; ++h) write_from_double(out, t * H + h, acc[static_cast<std::size_t>(h)]);
  }
  return out;
}

std::vector<float> reference_gather(const Tensor& values, const std::vector<std::int64_t>& slot) {
  std::vector<float> out(slot.size(), 0.0f);
  for (std::size_t i = 0; i < slot.size(); ++i)
    if (slot[i] >= 0) out[i] = values.data<float>()[slot[i]];
  return out;
}

bool all_bytes(const Tensor& host, int byte) {
  const auto* p = static_cast<const unsigned char*>(host.raw());
  for (std::size_t i = 0; i < host.nbytes(); ++i)
    if (p[i] != static_cast<unsigned char>(byte)) return false;
  return true;
}

// The whole local path on one routing: plan, permute (vs core permute), unpermute of random expert
// rows (padding rows hold garbage that must be ignored), gather_slot_values.
void check_roundtrip(const Routed& r, const PlanParams& params, std::int64_t H, DType dt, std::uint64_t seed,
                     cudaStream_t stream) {
  const std::int64_t T = r.indices.size(0), k = r.indices.size(1);
  const RefPlan ref = reference_plan(r.indices, params);
  const std::int64_t N = ref.layout().out_rows;
  const Tensor x = random_tensor({T, H}, dt, seed);

  DeviceErrors errors(0);
  const Tensor idx_d = cuda::to_device(r.indices, 0, stream);
  const Tensor x_d = cuda::to_device(x, 0, stream);
  const Tensor w_d = cuda::to_device(r.weights, 0, stream);
  LocalPlan plan = cuda::make_local_plan(T, k, params, 0, stream);
  poison_plan(plan, stream);
  cuda::plan_local_into(plan, idx_d, errors, stream);
  ASSERT_EQ(plan.out_rows, N);

  // permute
  Tensor want_tokens = Tensor::empty({N, H}, dt), want_probs = Tensor::empty({N}, DType::f32);
  permute(x, r.weights, ref.rows, want_tokens, want_probs);
  const Tensor tokens_d = device_empty({N, H}, dt), probs_d = device_empty({N}, DType::f32);
  poison(tokens_d, stream, kPoison);
  poison(probs_d, stream, kPoison);
  cuda::permute(x_d, w_d, plan, tokens_d, probs_d, stream);
  EXPECT_TRUE(same_bytes(cuda::to_host(tokens_d, stream), want_tokens)) << "permuted tokens";
  EXPECT_TRUE(same_bytes(cuda::to_host(probs_d, stream), want_probs)) << "permuted probs";

  // unpermute of arbitrary expert rows
  const Tensor rows = random_tensor({N, H}, dt, seed + 1);
  const Tensor want_out = reference_unpermute(rows, r.indices, ref.rows, dt);
  Tensor core_out = Tensor::empty({T, H}, dt);
  unpermute(rows, r.indices, ref.rows, core_out);
  ASSERT_TRUE(same_bytes(core_out, want_out)) << "the test's reference disagrees with core unpermute";
  const Tensor rows_d = cuda::to_device(rows, 0, stream);
  const Tensor out_d = device_empty({T, H}, dt);
  poison(out_d, stream, kPoison);
  cuda::unpermute(rows_d, plan, out_d, stream);
  EXPECT_TRUE(same_bytes(cuda::to_host(out_d, stream), want_out)) << "unpermute";

  // gather_slot_values
  const Tensor values = random_tensor({N}, DType::f32, seed + 2);
  const Tensor values_d = cuda::to_device(values, 0, stream);
  const Tensor grad_d = device_empty({T, k}, DType::f32);
  poison(grad_d, stream, kPoison);
  cuda::gather_slot_values(values_d, plan, grad_d, stream);
  EXPECT_TRUE(same_bytes(cuda::to_host(grad_d, stream),
                         Tensor::from_vector(reference_gather(values, ref.rows), {T, k})))
      << "gather_slot_values";
  errors.check(stream, "test");
}

TEST(Permute, MatchesCpuAcrossRoutingsSizesAndDtypes) {
  if (!require_gpus(1)) return;
  TestStream stream;
  std::uint64_t n = 0;
  for (Routing kind : {Routing::uniform, Routing::zipf, Routing::one_expert})
    for (int E : {1, 8, 64, 256})
      for (int k : {1, 2, 8})
        for (std::int64_t pad : {1, 16, 128})
          for (std::int64_t T : {0, 1, 37}) {
            ++n;
            const std::int64_t H = n % 2 ? 8 : 2048;
            const DType dt = (n / 2) % 2 ? DType::bf16 : DType::f32;
            SCOPED_TRACE(std::string(routing_name(kind)) + " E=" + std::to_string(E) + " k=" + std::to_string(k) +
                         " pad=" + std::to_string(pad) + " T=" + std::to_string(T) + " H=" + std::to_string(H) + " " +
                         std::string(dtype_name(dt)));
            const Routed r = make_routing(T, k, E, kind, n % 3 ? DType::i64 : DType::i32, 0.15, 1000 + n);
            check_roundtrip(r, local_params(E, pad), H, dt, 2000 + n, stream);
          }
}

TEST(Permute, LargeHiddenAndManyTokens) {
  if (!require_gpus(1)) return;
  TestStream stream;
  {
    SCOPED_TRACE("dsv3-like uniform, bf16 H=7168, pad 128");
    check_roundtrip(make_routing(2048, 8, 64, Routing::uniform, DType::i64, 0.02, 1), local_params(64, 128), 7168,
                    DType::bf16, 11, stream);
  }
  {
    SCOPED_TRACE("zipf, bf16 H=7168, pad 16");
    check_roundtrip(make_routing(2048, 8, 64, Routing::zipf, DType::i32, 0.0, 2), local_params(64, 16), 7168,
                    DType::bf16, 12, stream);
  }
  {
    SCOPED_TRACE("E=256 budget with slack, bf16 H=7168");
    check_roundtrip(make_routing(512, 8, 256, Routing::uniform, DType::i64, 0.1, 3),
                    local_params(256, 16, 512 * 8 + 256 * 16), 7168, DType::bf16, 13, stream);
  }
  {
    SCOPED_TRACE("odd T, f32 H=2048");
    check_roundtrip(make_routing(1023, 2, 8, Routing::zipf, DType::i64, 0.1, 4), local_params(8, 1), 2048,
                    DType::f32, 14, stream);
  }
  {
    SCOPED_TRACE("all tokens on one expert, bf16 H=7168");
    check_roundtrip(make_routing(1001, 8, 64, Routing::one_expert, DType::i64, 0.0, 5), local_params(64, 128), 7168,
                    DType::bf16, 15, stream);
  }
}

TEST(Permute, BudgetTailIsZeroAndNothingIsWrittenPastTheBudget) {
  if (!require_gpus(1)) return;
  TestStream stream;
  const int E = 16, k = 4;
  const std::int64_t T = 301, H = 64, pad = 16, guard = 5;
  const Routed r = make_routing(T, k, E, Routing::zipf, DType::i64, 0.1, 71);
  const std::int64_t required = reference_plan(r.indices, local_params(E, pad)).layout().required_rows;
  const Tensor x = random_tensor({T, H}, DType::bf16, 72);
  const Tensor idx_d = cuda::to_device(r.indices, 0, stream);
  const Tensor x_d = cuda::to_device(x, 0, stream);
  const Tensor w_d = cuda::to_device(r.weights, 0, stream);
  struct Case {
    const char* name;
    std::int64_t budget;
    OverflowPolicy policy;
  };
  for (const Case& c : {Case{"slack", required + 3 * pad, OverflowPolicy::error},
                        Case{"drop", required / 2 / pad * pad, OverflowPolicy::drop},
                        Case{"overflow", required / 2 / pad * pad, OverflowPolicy::error}}) {
    SCOPED_TRACE(c.name);
    const bool overflow = c.budget < required && c.policy == OverflowPolicy::error;
    // Under an overflow error the device writes the drop layout (and reports the error).
    const RefPlan ref = reference_plan(r.indices, local_params(E, pad, c.budget, OverflowPolicy::drop));
    DeviceErrors errors(0);
    LocalPlan plan = cuda::make_local_plan(T, k, local_params(E, pad, c.budget, c.policy), 0, stream);
    poison_plan(plan, stream);
    cuda::plan_local_into(plan, idx_d, errors, stream);

    const Tensor tokens_full = device_empty({c.budget + guard, H}, DType::bf16);
    const Tensor probs_full = device_empty({c.budget + guard}, DType::f32);
    poison(tokens_full, stream, kPoison);
    poison(probs_full, stream, kPoison);
    const TensorView tokens_d = tokens_full.view().rows(0, c.budget);
    const TensorView probs_d = probs_full.view().rows(0, c.budget);
    cuda::permute(x_d, w_d, plan, tokens_d, probs_d, stream);
    const Tensor out_d = device_empty({T, H}, DType::bf16);
    cuda::unpermute(tokens_d, plan, out_d, stream);

    Tensor want_tokens = Tensor::empty({c.budget, H}, DType::bf16), want_probs = Tensor::empty({c.budget}, DType::f32);
    permute(x, r.weights, ref.rows, want_tokens, want_probs);
    const Tensor got_tokens = cuda::to_host(tokens_full, stream);
    const Tensor got_probs = cuda::to_host(probs_full, stream);
    EXPECT_TRUE(same_bytes(Tensor::wrap(got_tokens.view().rows(0, c.budget)), want_tokens));
    EXPECT_TRUE(same_bytes(Tensor::wrap(got_probs.view().rows(0, c.budget)), want_probs));
    EXPECT_TRUE(all_bytes(Tensor::wrap(got_tokens.view().rows(c.budget, c.budget + guard)), kPoison))
        << "rows past the budget were written";
    EXPECT_TRUE(all_bytes(Tensor::wrap(got_probs.view().rows(c.budget, c.budget + guard)), kPoison))
        << "probs past the budget were written";
    EXPECT_TRUE(same_bytes(cuda::to_host(out_d, stream),
                           reference_unpermute(want_tokens, r.indices, ref.rows, DType::bf16)));
    expect_plan_eq(plan, ref, stream);
    if (overflow) {
      try {
        errors.check(stream, "dispatch");
        ADD_FAILURE() << "overflow not reported";
      } catch (const ArgumentError& e) {
        EXPECT_EQ(e.argument(), "budget_rows");
      }
    } else {
      errors.check(stream, "dispatch");
    }
  }
}

TEST(Permute, IdentityExpertsGiveCountTimesX) {
  if (!require_gpus(1)) return;
  TestStream stream;
  for (DType dt : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dt));
    const int E = 16, k = 4;
    const std::int64_t T = 129, H = 2048;
    const Routed r = make_routing(T, k, E, Routing::uniform, DType::i64, 0.3, 81);
    const Tensor x = random_tensor({T, H}, dt, 82);
    DeviceErrors errors(0);
    const Tensor idx_d = cuda::to_device(r.indices, 0, stream);
    const Tensor x_d = cuda::to_device(x, 0, stream);
    const Tensor w_d = cuda::to_device(r.weights, 0, stream);
    const LocalPlan plan = cuda::plan_local(idx_d, local_params(E, 16), errors, stream);
    const Tensor tokens_d = device_empty({plan.out_rows, H}, dt), probs_d = device_empty({plan.out_rows}, DType::f32);
    cuda::permute(x_d, w_d, plan, tokens_d, probs_d, stream);
    const Tensor out_d = device_empty({T, H}, dt);
    poison(out_d, stream, kPoison);
    cuda::unpermute(tokens_d, plan, out_d, stream);
    const Tensor got = cuda::to_host(out_d, stream);
    Tensor want = Tensor::empty({T, H}, dt);
    for (std::int64_t t = 0; t < T; ++t) {
      int count = 0;
      for (int j = 0; j < k; ++j) count += index_at(r.indices, t * k + j) >= 0;
      // count * x is exact in fp32 (x has at most 24 significant bits, count <= 4).
      for (std::int64_t h = 0; h < H; ++h)
        write_from_double(want, t * H + h,
                          static_cast<float>(count) * static_cast<float>(read_as_double(x, t * H + h)));
    }
    EXPECT_TRUE(same_bytes(got, want));
  }
}

TEST(Permute, MatchesHostDispatcherWithOneRank) {
  if (!require_gpus(1)) return;
  TestStream stream;
  const int E = 32, k = 4;
  const std::int64_t T = 200, H = 48;
  const Routed r = make_routing(T, k, E, Routing::zipf, DType::i64, 0.1, 91);
  const Tensor x = random_tensor({T, H}, DType::f32, 92);

  auto dispatcher = make_host_dispatcher(std::make_shared<HostWorld>(1), 0, E);
  DispatchInput in;
  in.hidden = x;
  in.indices = r.indices;
  in.weights = r.weights;
  DispatchOptions options;
  options.pad_multiple = 16;
  const DispatchResult res = dispatcher->dispatch(in, options);
  const Tensor combined = dispatcher->combine(res.handle, res.tokens);

  DeviceErrors errors(0);
  const Tensor idx_d = cuda::to_device(r.indices, 0, stream);
  const Tensor x_d = cuda::to_device(x, 0, stream);
  const Tensor w_d = cuda::to_device(r.weights, 0, stream);
  const LocalPlan plan = cuda::plan_local(idx_d, local_params(E, 16), errors, stream);
  ASSERT_EQ(plan.out_rows, res.tokens.size(0));
  EXPECT_TRUE(same_bytes(plan.host_tokens_per_expert, res.tokens_per_expert));
  const Tensor tokens_d = device_empty({plan.out_rows, H}, DType::f32);
  const Tensor probs_d = device_empty({plan.out_rows}, DType::f32);
  poison(tokens_d, stream, kPoison);
  poison(probs_d, stream, kPoison);
  cuda::permute(x_d, w_d, plan, tokens_d, probs_d, stream);
  EXPECT_TRUE(same_bytes(cuda::to_host(tokens_d, stream), res.tokens));
  EXPECT_TRUE(same_bytes(cuda::to_host(probs_d, stream), res.token_probs));
  const Tensor out_d = device_empty({T, H}, DType::f32);
  cuda::unpermute(tokens_d, plan, out_d, stream);
  EXPECT_TRUE(same_bytes(cuda::to_host(out_d, stream), combined));
}

TEST(Permute, MixedDtypeUnpermuteRoundsOnce) {
  if (!require_gpus(1)) return;
  TestStream stream;
  const int E = 8, k = 2;
  const std::int64_t T = 77, H = 24;
  const Routed r = make_routing(T, k, E, Routing::uniform, DType::i32, 0.1, 95);
  DeviceErrors errors(0);
  const Tensor idx_d = cuda::to_device(r.indices, 0, stream);
  const LocalPlan plan = cuda::plan_local(idx_d, local_params(E, 1), errors, stream);
  const RefPlan ref = reference_plan(r.indices, local_params(E, 1));
  for (auto [in_dt, out_dt] : {std::pair{DType::bf16, DType::f32}, std::pair{DType::f32, DType::bf16}}) {
    SCOPED_TRACE(std::string(dtype_name(in_dt)) + " -> " + std::string(dtype_name(out_dt)));
    const Tensor rows = random_tensor({plan.out_rows, H}, in_dt, 96);
    const Tensor rows_d = cuda::to_device(rows, 0, stream);
    const Tensor out_d = device_empty({T, H}, out_dt);
    poison(out_d, stream, kPoison);
    cuda::unpermute(rows_d, plan, out_d, stream);
    EXPECT_TRUE(same_bytes(cuda::to_host(out_d, stream), reference_unpermute(rows, r.indices, ref.rows, out_dt)));
  }
}

// Capture plan (budget mode) + permute + unpermute once, then replay with new inputs written into
// the same buffers; every replay must equal the CPU on its inputs.
TEST(Permute, CudaGraphReplaysPlanPermuteUnpermute) {
  if (!require_gpus(1)) return;
  TestStream stream;
  const int E = 32, k = 8;
  const std::int64_t T = 1500, H = 128, pad = 16;
  for (bool drop : {false, true}) {
    SCOPED_TRACE(drop ? "drop policy, small budget" : "error policy, budget that always fits");
    const std::int64_t budget = drop ? 4096 : (T * k + E * (pad - 1) + pad - 1) / pad * pad;
    const PlanParams params =
        local_params(E, pad, budget, drop ? OverflowPolicy::drop : OverflowPolicy::error);
    DeviceErrors errors(0);
    LocalPlan plan = cuda::make_local_plan(T, k, params, 0, stream);
    const Tensor idx_d = device_empty({T, k}, DType::i64);
    const Tensor x_d = device_empty({T, H}, DType::bf16);
    const Tensor w_d = device_empty({T, k}, DType::f32);
    const Tensor tokens_d = device_empty({budget, H}, DType::bf16);
    const Tensor probs_d = device_empty({budget}, DType::f32);
    const Tensor out_d = device_empty({T, H}, DType::bf16);
    cuda::zero_async(idx_d, stream);  // any valid routing; capture does not run it
    (void)cuda::sm_count(0);          // cached before capture (it is a plain attribute query anyway)
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));

    const cuda::CapturedGraph graph(stream, cudaStreamCaptureModeGlobal, [&] {
      cuda::plan_local_into(plan, idx_d, errors, stream);
      cuda::permute(x_d, w_d, plan, tokens_d, probs_d, stream);
      cuda::unpermute(tokens_d, plan, out_d, stream);
    });

    for (int replay = 0; replay < 10; ++replay) {
      SCOPED_TRACE("replay " + std::to_string(replay));
      const Routed r =
          make_routing(T, k, E, replay % 2 ? Routing::zipf : Routing::uniform, DType::i64, 0.1, 300 + replay);
      const Tensor x = random_tensor({T, H}, DType::bf16, 400 + replay);
      cuda::copy_async(idx_d, r.indices, stream);
      cuda::copy_async(x_d, x, stream);
      cuda::copy_async(w_d, r.weights, stream);
      poison(tokens_d, stream, kPoison);
      poison(probs_d, stream, kPoison);
      poison(out_d, stream, kPoison);
      graph.launch(stream);
      errors.check(stream, "graph replay");

      const RefPlan ref = reference_plan(r.indices, params);
      if (drop) {
        EXPECT_GT(ref.layout().dropped, 0);
      }
      expect_plan_eq(plan, ref, stream);
      Tensor want_tokens = Tensor::empty({budget, H}, DType::bf16), want_probs = Tensor::empty({budget}, DType::f32);
      permute(x, r.weights, ref.rows, want_tokens, want_probs);
      EXPECT_TRUE(same_bytes(cuda::to_host(tokens_d, stream), want_tokens));
      EXPECT_TRUE(same_bytes(cuda::to_host(probs_d, stream), want_probs));
      EXPECT_TRUE(same_bytes(cuda::to_host(out_d, stream),
                             reference_unpermute(want_tokens, r.indices, ref.rows, DType::bf16)));
    }
  }
}

TEST(Permute, ArgumentsAreCheckedAgainstThePlan) {
  if (!require_gpus(1)) return;
  TestStream stream;
  const int E = 8, k = 2;
  const std::int64_t T = 10, H = 16;
  const Routed r = make_routing(T, k, E, Routing::uniform, DType::i64, 0.0, 99);
  DeviceErrors errors(0);
  const Tensor idx_d = cuda::to_device(r.indices, 0, stream);
  const LocalPlan plan = cuda::plan_local(idx_d, local_params(E, 1), errors, stream);
  const std::int64_t N = plan.out_rows;
  const Tensor x_d = cuda::to_device(random_tensor({T, H}, DType::bf16, 1), 0, stream);
  const Tensor w_d = cuda::to_device(r.weights, 0, stream);
  const Tensor tokens_d = device_empty({N, H}, DType::bf16), probs_d = device_empty({N}, DType::f32);
  auto arg_of = [&](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const ArgumentError& e) {
      return e.argument();
    }
    return "(nothing thrown)";
  };
  const Tensor x12 = device_empty({T, 12}, DType::bf16);
  const Tensor tokens12 = device_empty({N, 12}, DType::bf16);
  EXPECT_EQ(arg_of([&] { cuda::permute(x12, w_d, plan, tokens12, probs_d, stream); }), "hidden");  // H % 8
  EXPECT_EQ(arg_of([&] { cuda::permute(x_d.view().rows(1, T), w_d, plan, tokens_d, probs_d, stream); }), "hidden");
  EXPECT_EQ(arg_of([&] { cuda::permute(x_d, w_d.view().rows(1, T), plan, tokens_d, probs_d, stream); }), "weights");
  EXPECT_EQ(arg_of([&] { cuda::permute(x_d, w_d, plan, tokens_d.view().rows(1, N), probs_d, stream); }),
            "out_tokens");
  const Tensor tokens_f32 = device_empty({N, H}, DType::f32);
  EXPECT_EQ(arg_of([&] { cuda::permute(x_d, w_d, plan, tokens_f32, probs_d, stream); }), "out_tokens");
  EXPECT_EQ(arg_of([&] { cuda::permute(x_d, w_d, plan, tokens_d, probs_d.view().rows(1, N), stream); }), "out_probs");
  const Tensor x_cpu = random_tensor({T, H}, DType::bf16, 2);
  EXPECT_EQ(arg_of([&] { cuda::permute(x_cpu, w_d, plan, tokens_d, probs_d, stream); }), "hidden");
  const Tensor out_d = device_empty({T, H}, DType::bf16);
  EXPECT_EQ(arg_of([&] { cuda::unpermute(tokens_d.view().rows(1, N), plan, out_d, stream); }), "expert_rows");
  EXPECT_EQ(arg_of([&] { cuda::unpermute(tokens_d, plan, out_d.view().rows(1, T), stream); }), "out");
  const Tensor grad_d = device_empty({T, k}, DType::f32);
  EXPECT_EQ(arg_of([&] { cuda::gather_slot_values(probs_d.view().rows(1, N), plan, grad_d, stream); }), "values");
  LocalPlan blank = cuda::make_local_plan(T, k, local_params(E, 1), 0, stream);  // blocking: not computed yet
  EXPECT_EQ(arg_of([&] { cuda::permute(x_d, w_d, blank, tokens_d, probs_d, stream); }), "plan");
}

}  // namespace
}  // namespace flexep::testing
