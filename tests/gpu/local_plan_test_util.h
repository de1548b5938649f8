// Helpers of the local plan / permute GPU tests: routings, the CPU reference (core/plan.h with R = 1)
// and device <-> host plumbing.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "flexep/core/plan.h"
#include "flexep/core/routing.h"
#include "flexep/core/synthetic_routing.h"
#include "flexep/cuda/local_plan.h"
#include "flexep/cuda/runtime.h"
#include "cpu/same_bytes.h"
#include "gpu/gpu_test_util.h"

namespace flexep::testing {

// A non-blocking stream (nothing relies on the legacy stream's implicit syncs), also the allocator's
// stream while it lives. Declare it before the tensors of a test so that they are freed first.
class TestStream {
 public:
  TestStream() : stream_(cudaStreamNonBlocking) { guard_.emplace(stream_.get()); }
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
  cudaStream_t get() const { return stream_; }
  operator cudaStream_t() const { return stream_; }  // NOLINT

 private:
  cuda::OwnedStream stream_;                // retired and destroyed after the guard below
  std::optional<cuda::StreamGuard> guard_;
};

enum class Routing { uniform, zipf, one_expert };

inline const char* routing_name(Routing r) {
  switch (r) {
    case Routing::uniform: return "uniform";
    case Routing::zipf: return "zipf";
    case Routing::one_expert: return "one_expert";
  }
  return "?";
}

struct Routed {
  Tensor indices;  // [T, k] CPU, i32 or i64
  Tensor weights;  // [T, k] CPU f32, never 0 (also on -1 slots, which must not be copied anywhere)
};

// uniform / zipf: synthetic_topk (distinct experts; slots beyond E are -1), then about p_none of the
// slots set to -1. one_expert: every token's slot 0 is expert E - 1, the other slots -1.
inline Routed make_routing(std::int64_t T, int k, int E, Routing kind, DType index_dtype, double p_none,
                           std::uint64_t seed) {
  Tensor idx = Tensor::empty({T, k}, DType::i64);
  Tensor w = Tensor::empty({T, k}, DType::f32);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  for (std::int64_t i = 0; i < T * k; ++i) {
    idx.data<std::int64_t>()[i] = -1;
    w.data<float>()[i] = weight(rng);
  }
  if (kind == Routing::one_expert) {
    for (std::int64_t t = 0; t < T; ++t) idx.data<std::int64_t>()[t * k] = E - 1;
  } else if (T > 0) {
    const int kk = std::min(k, E);
    RoutingSpec spec;
    spec.kind = kind == Routing::zipf ? RoutingKind::zipf : RoutingKind::uniform;
    const TopK tk = synthetic_topk(T, kk, E, spec, seed);
    std::bernoulli_distribution none(p_none);
    for (std::int64_t t = 0; t < T; ++t)
      for (int j = 0; j < kk; ++j) {
        const std::int64_t e = tk.indices.data<std::int64_t>()[t * kk + j];
        idx.data<std::int64_t>()[t * k + j] = none(rng) ? -1 : e;
        w.data<float>()[t * k + j] = tk.weights.data<float>()[t * kk + j];
      }
  }
  return {index_dtype == DType::i64 ? idx : idx.to(DType::i32), w};
}

// Pseudo-random values in [-4, 4) with full fp32 mantissas (sums round), never all zero; fast
// enough for hundreds of millions of elements.
inline Tensor random_tensor(Shape shape, DType dtype, std::uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::f32);
  float* p = t.data<float>();
  std::uint64_t z = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    z += 0x9E3779B97F4A7C15ull;  // splitmix64
    std::uint64_t v = z;
    v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull;
    v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
    v ^= v >> 31;
    p[i] = static_cast<float>(v >> 40) * (8.0f / 16777216.0f) - 4.0f;
  }
  return dtype == DType::f32 ? t : t.to(dtype);
}

// The oracle: core/plan.h with R = 1 on the same indices.
struct RefPlan {
  DispatchPlan plan;
  std::vector<std::int64_t> rows;  // slot_rows(plan, 0, indices)
  const RankLayout& layout() const { return plan.ranks[0]; }
};

inline RefPlan reference_plan(const Tensor& indices, const PlanParams& params) {
  RefPlan r;
  r.plan = DispatchPlan::build(expert_counts(indices, params.experts), params);
  r.rows = slot_rows(r.plan, 0, indices);
  return r;
}

inline PlanParams local_params(int E, std::int64_t pad, std::optional<std::int64_t> budget = std::nullopt,
                               OverflowPolicy overflow = OverflowPolicy::error) {
  PlanParams p;
  p.ranks = 1;
  p.experts = E;
  p.pad_multiple = pad;
  p.budget_rows = budget;
  p.overflow = overflow;
  return p;
}

inline void poison(const TensorView& t, cudaStream_t stream, int byte = 0xA5) {
  if (t.nbytes()) FLEXEP_CUDA_CHECK(cudaMemsetAsync(t.data, byte, t.nbytes(), stream));
}

// Every device tensor of a plan filled with garbage, so that a value the kernels fail to write shows.
inline void poison_plan(const cuda::LocalPlan& plan, cudaStream_t stream) {
  for (const Tensor* t : {&plan.tokens_per_expert, &plan.used_rows, &plan.dropped, &plan.expert_begin,
                          &plan.kept_rows, &plan.slot_rows, &plan.workspace})
    poison(*t, stream, 0x5A);
}

inline std::vector<std::int64_t> host_i64(const TensorView& device_tensor, cudaStream_t stream) {
  const Tensor h = cuda::to_host(device_tensor, stream);
  std::vector<std::int64_t> v(static_cast<std::size_t>(h.numel()));
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = h.dtype() == DType::i32 ? h.data<std::int32_t>()[i] : h.data<std::int64_t>()[i];
  return v;
}

// The GPU plan equals the CPU one: layout, totals and every slot's row, exactly.
inline void expect_plan_eq(const cuda::LocalPlan& gpu, const RefPlan& ref, cudaStream_t stream) {
  const RankLayout& lay = ref.layout();
  EXPECT_EQ(gpu.out_rows, lay.out_rows);
  EXPECT_EQ(host_i64(gpu.tokens_per_expert, stream), lay.tokens_per_expert);
  EXPECT_EQ(host_i64(gpu.expert_begin, stream), lay.expert_begin);
  EXPECT_EQ(host_i64(gpu.kept_rows, stream), lay.kept_rows);
  std::int64_t used = 0;
  for (std::int64_t g : lay.tokens_per_expert) used += g;
  EXPECT_EQ(host_i64(gpu.used_rows, stream), std::vector<std::int64_t>{used});
  EXPECT_EQ(host_i64(gpu.dropped, stream), std::vector<std::int64_t>{lay.dropped});
  const std::vector<std::int64_t> rows = host_i64(gpu.slot_rows, stream);
  ASSERT_EQ(rows.size(), ref.rows.size());
  std::int64_t mismatches = 0;
  for (std::size_t i = 0; i < rows.size(); ++i)
    if (rows[i] != ref.rows[i] && mismatches++ < 5)
      ADD_FAILURE() << "slot " << i << " (token " << i / static_cast<std::size_t>(gpu.topk) << "): row "
                    << rows[i] << ", expected " << ref.rows[i];
  EXPECT_EQ(mismatches, 0);
  if (!gpu.budget_mode()) {
    ASSERT_TRUE(gpu.host_tokens_per_expert.defined());
    const Tensor& h = gpu.host_tokens_per_expert;
    EXPECT_EQ(std::vector<std::int64_t>(h.data<std::int64_t>(), h.data<std::int64_t>() + h.numel()),
              lay.tokens_per_expert);
  }
}

}  // namespace flexep::testing
