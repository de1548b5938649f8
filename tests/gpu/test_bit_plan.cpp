// The hybridep bit plan (src/dispatch/hybridep/bit_plan.cu: one CTA, bits per (expert, token))
// against the general single-GPU plan (cuda::plan_local: sort based) on the same indices, pad 1 and
// no budget as hybridep uses it: counts, offsets and every slot's row identical; bad ids reported
// with the same argument, token and slot. (Every hybridep multi-GPU test runs it too, end to end.)
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "flexep/cuda/runtime.h"

#include "flexep/core/error.h"
#include "flexep/cuda/local_plan.h"
#include "gpu/bit_plan_kernels.h"
#include "gpu/local_plan_test_util.h"

namespace flexep::testing {
namespace {

struct DevicePlan {
  Tensor counts, begin, slot_rows;  // device
};

DevicePlan bit_plan(const Tensor& idx, int E, cuda::DeviceErrors& errors, cudaStream_t stream) {
  const std::int64_t T = idx.size(0), k = idx.size(1);
  DevicePlan p{Tensor::empty({E}, DType::i64, Device::cuda(0)), Tensor::empty({E}, DType::i64, Device::cuda(0)),
               Tensor::empty({T, k}, DType::i32, Device::cuda(0))};
  FLEXEP_CUDA_CHECK(cudaMemsetAsync(p.counts.raw(), 0xff, E * 8, stream));  // poison
  FLEXEP_CUDA_CHECK(cudaMemsetAsync(p.begin.raw(), 0xff, E * 8, stream));
  if (T * k > 0) FLEXEP_CUDA_CHECK(cudaMemsetAsync(p.slot_rows.raw(), 0x7f, T * k * 4, stream));
  run_bit_plan(idx.raw(), idx.dtype() == DType::i64, T, static_cast<int>(k), E, p.counts.data<std::int64_t>(),
               p.begin.data<std::int64_t>(), p.slot_rows.data<std::int32_t>(), errors.record(), stream);
  return p;
}

std::vector<std::int64_t> host_i64(const Tensor& t, cudaStream_t s) {
  const Tensor h = cuda::to_host(t, s).to(DType::i64);
  return std::vector<std::int64_t>(h.data<std::int64_t>(), h.data<std::int64_t>() + h.numel());
}

TEST(HybridEpBitPlan, MatchesTheGeneralPlan) {
  if (!require_gpus(1)) return;
  TestStream stream;
  std::uint64_t seed = 7;
  for (Routing kind : {Routing::uniform, Routing::zipf, Routing::one_expert})
    for (int E : {1, 8, 64, 256})
      for (int k : {1, 2, 8})
        for (std::int64_t T : {0, 1, 37, 4096, 6000})
          for (DType dt : {DType::i32, DType::i64}) {
            if (!bit_plan_takes(T, E)) continue;
            SCOPED_TRACE(std::string(routing_name(kind)) + " E " + std::to_string(E) + " k " + std::to_string(k) +
                         " T " + std::to_string(T) + (dt == DType::i64 ? " i64" : " i32"));
            const Routed r = make_routing(T, k, E, kind, dt, 0.1, seed++);
            const Tensor idx = cuda::to_device(r.indices, 0, stream);
            PlanParams params;
            params.ranks = 1;
            params.experts = E;
            cuda::DeviceErrors errors(0);
            const cuda::LocalPlan want = cuda::plan_local(idx, params, errors, stream);
            const DevicePlan got = bit_plan(idx, E, errors, stream);
            errors.check(stream, "bit plan");
            EXPECT_EQ(host_i64(got.counts, stream), host_i64(want.kept_rows, stream));
            EXPECT_EQ(host_i64(got.begin, stream), host_i64(want.expert_begin, stream));
            if (T * k > 0) {
              EXPECT_EQ(host_i64(got.slot_rows, stream), host_i64(want.slot_rows, stream));
            }
          }
}

TEST(HybridEpBitPlan, TakesDsv3SizesAndLeavesHugeRanksToTheGeneralPlan) {
  EXPECT_TRUE(bit_plan_takes(4096, 64));
  EXPECT_TRUE(bit_plan_takes(128, 256));
  EXPECT_FALSE(bit_plan_takes(1 << 20, 256));
}

// An out-of-range id and a repeated expert: reported as the general plan reports them (argument
// `indices`, the token and the later slot).
TEST(HybridEpBitPlan, BadIdsAreReportedWithTokenAndSlot) {
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
    bit_plan(idx, E, errors, stream);
    try {
      errors.check(stream, "bit plan");
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
