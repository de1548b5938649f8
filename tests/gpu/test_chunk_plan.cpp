// The hybridep chunk plan (src/dispatch/hybridep/kernels/chunk_plan.cu: chunks of tokens on the preprocess
// SMs, bits per (expert, token)) against the general single-GPU plan (cuda::plan_local: sort based)
// on the same indices, pad 1 and no budget as hybridep uses it: identical counts, and every slot's
// row = the general plan's expert offset + chunk base + rank in the chunk; on several grid sizes
// (CTAs looping over chunks) and twice on the same buffers (the CTA counter is zero again after a
// call). Bad ids reported with the same argument, token and slot. (Every hybridep multi-GPU test
// runs it too, end to end.)
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "flexep/core/error.h"
#include "flexep/cuda/local_plan.h"
#include "flexep/cuda/runtime.h"
#include "gpu/chunk_plan_kernels.h"
#include "gpu/local_plan_test_util.h"

namespace flexep::testing {
namespace {

struct DevicePlan {
  Tensor counts, chunk_base, slot_rank, done;  // device
};

std::int64_t chunks_of(std::int64_t T) {
  const std::int64_t c = chunk_plan_chunk_tokens();
  return T > 0 ? (T + c - 1) / c : 1;
}

DevicePlan make_device_plan(std::int64_t T, std::int64_t k, int E, cudaStream_t stream) {
  DevicePlan p{Tensor::empty({E}, DType::i64, Device::cuda(0)),
               Tensor::empty({chunks_of(T), E}, DType::i32, Device::cuda(0)),
               Tensor::empty({T, k}, DType::i32, Device::cuda(0)), Tensor::empty({1}, DType::i32, Device::cuda(0))};
  cuda::zero_async(p.done, stream);
  return p;
}

void chunk_plan(const Tensor& idx, int E, int grid, DevicePlan& p, cuda::DeviceErrors& errors, cudaStream_t stream) {
  const std::int64_t T = idx.size(0), k = idx.size(1);
  FLEXEP_CUDA_CHECK(cudaMemsetAsync(p.counts.raw(), 0xff, E * 8, stream));  // poison
  FLEXEP_CUDA_CHECK(cudaMemsetAsync(p.chunk_base.raw(), 0x7f, p.chunk_base.nbytes(), stream));
  if (T * k > 0) FLEXEP_CUDA_CHECK(cudaMemsetAsync(p.slot_rank.raw(), 0x7f, T * k * 4, stream));
  run_chunk_plan(idx.raw(), idx.dtype() == DType::i64, T, static_cast<int>(k), E, grid, p.counts.data<std::int64_t>(),
                 p.chunk_base.data<std::int32_t>(), p.slot_rank.data<std::int32_t>(),
                 reinterpret_cast<std::uint32_t*>(p.done.raw()), errors.record(), stream);
}

std::vector<std::int64_t> host_i64(const Tensor& t, cudaStream_t s) {
  const Tensor h = cuda::to_host(t, s).to(DType::i64);
  return std::vector<std::int64_t>(h.data<std::int64_t>(), h.data<std::int64_t>() + h.numel());
}

// Every slot's row in expert-major order: the general plan's expert offsets + chunk base + rank.
std::vector<std::int64_t> rows_of(const DevicePlan& p, const Tensor& host_idx, const std::vector<std::int64_t>& begin,
                                  int E, cudaStream_t s) {
  const std::int64_t T = host_idx.size(0), k = host_idx.size(1);
  const Tensor idx = host_idx.to(DType::i64);
  const std::vector<std::int64_t> base = host_i64(p.chunk_base, s), rank = host_i64(p.slot_rank, s);
  std::vector<std::int64_t> rows;
  for (std::int64_t i = 0; i < T * k; ++i) {
    const std::int64_t e = idx.data<std::int64_t>()[i], r = rank[static_cast<std::size_t>(i)];
    if (r < 0) {
      rows.push_back(-1);
      continue;
    }
    const std::int64_t chunk = (i / k) / chunk_plan_chunk_tokens();
    rows.push_back(begin[static_cast<std::size_t>(e)] + base[static_cast<std::size_t>(chunk * E + e)] + r);
  }
  return rows;
}

TEST(HybridEpChunkPlan, MatchesTheGeneralPlan) {
  if (!require_gpus(1)) return;
  TestStream stream;
  std::uint64_t seed = 7;
  for (Routing kind : {Routing::uniform, Routing::zipf, Routing::one_expert})
    for (int E : {1, 8, 64, 256})
      for (int k : {1, 2, 8})
        for (std::int64_t T : {0, 1, 37, 256, 4096, 6000})
          for (DType dt : {DType::i32, DType::i64}) {
            if (k > E) continue;
            const Routed r = make_routing(T, k, E, kind, dt, 0.1, seed++);
            const Tensor idx = cuda::to_device(r.indices, 0, stream);
            PlanParams params;
            params.ranks = 1;
            params.experts = E;
            cuda::DeviceErrors errors(0);
            const cuda::LocalPlan want = cuda::plan_local(idx, params, errors, stream);
            const std::vector<std::int64_t> begin = host_i64(want.expert_begin, stream);
            DevicePlan got = make_device_plan(T, k, E, stream);
            for (int grid : {1, 3, 16, 16}) {  // 16 twice: the same buffers, the counter zero again
              SCOPED_TRACE(std::string(routing_name(kind)) + " E " + std::to_string(E) + " k " + std::to_string(k) +
                           " T " + std::to_string(T) + (dt == DType::i64 ? " i64" : " i32") + " grid " +
                           std::to_string(grid));
              chunk_plan(idx, E, grid, got, errors, stream);
              errors.check(stream, "chunk plan");
              EXPECT_EQ(host_i64(got.counts, stream), host_i64(want.kept_rows, stream));
              if (T * k > 0) {
                EXPECT_EQ(rows_of(got, r.indices, begin, E, stream), host_i64(want.slot_rows, stream));
              }
              EXPECT_EQ(host_i64(got.done, stream), std::vector<std::int64_t>{0});
            }
          }
}

// hybridep has no other plan: the kernel takes every expert count a buffer allows (4096 in all,
// layout.cpp; a static_assert in chunk_plan.cu), and refuses what its shared memory cannot hold.
TEST(HybridEpChunkPlan, TakesEveryExpertCountOfAHybridEpBuffer) {
  EXPECT_TRUE(chunk_plan_takes(1));
  EXPECT_TRUE(chunk_plan_takes(64));
  EXPECT_TRUE(chunk_plan_takes(4096));
  EXPECT_FALSE(chunk_plan_takes(32768));
}

// An out-of-range id and a repeated expert: reported as the general plan reports them (argument
// `indices`, the token and the later slot).
TEST(HybridEpChunkPlan, BadIdsAreReportedWithTokenAndSlot) {
  if (!require_gpus(1)) return;
  TestStream stream;
  const int E = 8;
  for (int bad : {0, 1}) {
    std::vector<std::int32_t> ids = {0, 1, 2, 3, 4, 5};  // T = 3, k = 2
    if (bad == 0) ids[3] = 9;                            // token 1, slot 1: out of range
    if (bad == 1) ids[5] = 4;                            // token 2, slot 1: repeats slot 0
    const Tensor host = Tensor::from_vector(ids, {3, 2});
    const Tensor idx = cuda::to_device(host, 0, stream);
    cuda::DeviceErrors errors(0);
    DevicePlan p = make_device_plan(3, 2, E, stream);
    chunk_plan(idx, E, 2, p, errors, stream);
    try {
      errors.check(stream, "chunk plan");
      ADD_FAILURE() << "bad id " << bad << " not reported";
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.argument(), "indices");
      const std::string what = e.what();
      EXPECT_NE(what.find(bad == 0 ? "9" : "4"), std::string::npos) << what;
    }
  }
}

}  // namespace
}  // namespace flexep::testing
