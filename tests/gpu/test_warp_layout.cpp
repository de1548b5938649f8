// The preprocess kernel's per-receiver layout by one warp (src/dispatch/hybridep/kernels/warp_layout.cuh)
// against layout_math.h's receiver_layout() (itself checked against core/plan.cpp by the CPU tests):
// begin / kept / tokens_per_expert of every group and the totals, over group counts below, at and
// above one round of 32 lanes, pads 1 / 3 / 128, no budget and budgets below, at and above the rows
// needed, under both overflow policies, and group counts of zero.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "dispatch/hybridep/kernels/layout_math.h"
#include "flexep/cuda/runtime.h"
#include "gpu/local_plan_test_util.h"
#include "gpu/warp_layout_kernels.h"

namespace flexep::testing {
namespace {

using hybridep::LayoutParams;
using hybridep::ReceiverTotals;

struct CountMatrix {
  const std::vector<long long>& c;
  int experts;
  long long operator()(int s, int e) const { return c[static_cast<std::size_t>(s) * experts + e]; }
};

std::vector<std::int64_t> on_host(const Tensor& t, cudaStream_t s) {
  const Tensor h = cuda::to_host(t, s);
  return std::vector<std::int64_t>(h.data<std::int64_t>(), h.data<std::int64_t>() + h.numel());
}

TEST(HybridEpWarpLayout, MatchesReceiverLayout) {
  if (!require_gpus(1)) return;
  TestStream stream;
  std::mt19937_64 rng(11);
  struct Shape {
    int ranks, experts;
  };
  for (const Shape sh : {Shape{1, 1}, Shape{8, 40}, Shape{1, 32}, Shape{2, 64}, Shape{4, 132}, Shape{1, 64},
                         Shape{2, 2048}, Shape{32, 4096}})
    for (long long pad : {1LL, 3LL, 128LL})
      for (int zeros : {0, 1}) {
        const int R = sh.ranks, E = sh.experts, L = E / R;
        std::vector<long long> counts(static_cast<std::size_t>(R) * E);
        std::uniform_int_distribution<long long> n(0, 50);
        for (long long& x : counts) x = zeros && rng() % 3 == 0 ? 0 : n(rng);
        for (int d : {0, R - 1}) {
          const CountMatrix cm{counts, E};
          std::vector<long long> pairs(static_cast<std::size_t>(L));
          for (int le = 0; le < L; ++le) pairs[static_cast<std::size_t>(le)] = hybridep::group_pairs(cm, d * L + le, R);
          LayoutParams base{R, E, pad, -1, false};
          std::vector<long long> b0(L), k0(L), t0(L);
          const long long required = hybridep::receiver_layout(cm, d, base, b0.data(), k0.data(), t0.data()).required;
          const long long half = hybridep::round_up(required / 2, pad);
          for (long long budget : {-1LL, 0LL, half, required, required + pad})
            for (bool drop : {false, true}) {
              SCOPED_TRACE("R " + std::to_string(R) + " E " + std::to_string(E) + " receiver " + std::to_string(d) +
                           " pad " + std::to_string(pad) + " budget " + std::to_string(budget) +
                           (drop ? " drop" : " error") + (zeros ? " with empty groups" : ""));
              const LayoutParams p{R, E, pad, budget, drop};
              std::vector<long long> begin(L), kept(L), tpe(L);
              const ReceiverTotals want = hybridep::receiver_layout(cm, d, p, begin.data(), kept.data(), tpe.data());

              const std::vector<std::int64_t> pairs64(pairs.begin(), pairs.end());
              const Tensor dpairs = cuda::to_device(Tensor::from_vector(pairs64, {L}), 0, stream);
              Tensor dbegin = Tensor::empty({L}, DType::i64, Device::cuda(0));
              Tensor dkept = Tensor::empty({L}, DType::i64, Device::cuda(0));
              Tensor dtpe = Tensor::empty({L}, DType::i64, Device::cuda(0));
              Tensor dtot = Tensor::empty({5}, DType::i64, Device::cuda(0));
              for (Tensor* t : {&dbegin, &dkept, &dtpe, &dtot})  // poison: every value must be written
                FLEXEP_CUDA_CHECK(cudaMemsetAsync(t->raw(), 0x7f, t->nbytes(), stream));
              run_warp_receiver_layout(dpairs.data<std::int64_t>(), R, E, pad, budget, drop,
                                       dbegin.data<std::int64_t>(), dkept.data<std::int64_t>(),
                                       dtpe.data<std::int64_t>(), dtot.data<std::int64_t>(), stream);
              EXPECT_EQ(on_host(dbegin, stream), std::vector<std::int64_t>(begin.begin(), begin.end()));
              EXPECT_EQ(on_host(dkept, stream), std::vector<std::int64_t>(kept.begin(), kept.end()));
              EXPECT_EQ(on_host(dtpe, stream), std::vector<std::int64_t>(tpe.begin(), tpe.end()));
              EXPECT_EQ(on_host(dtot, stream), (std::vector<std::int64_t>{want.required, want.out_rows, want.used,
                                                                           want.dropped, want.overflow ? 1 : 0}));
            }
        }
      }
}

}  // namespace
}  // namespace flexep::testing
