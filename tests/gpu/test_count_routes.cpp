// The count kernel of the GPU backends (src/dispatch/common/count_routes.h) against a CPU count of
// the same ids: each slot's validated id, the pairs per expert, the tokens per destination rank,
// and where each token goes, in both forms (alltoall's flags [R, T], deepep's masks [R, T / 32]:
// the ballot path up to 32 ranks, the atomic path beyond). Ids include -1, ids out of range and
// repeats (reported, then treated as -1), so the counts say which slots were kept.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dispatch/common/count_routes.h"
#include "flexep/core/random.h"
#include "flexep/cuda/device_errors.h"
#include "flexep/cuda/runtime.h"
#include "gpu/gpu_test_util.h"

using namespace flexep;
using flexep::testing::host_vector;
using flexep::testing::require_gpus;

namespace {

struct Case {
  std::string name;
  int ranks, experts, k;
  std::int64_t tokens;
  bool i64;
};

// Ids of token t, slot j: mostly uniform over [0, E), with -1, E + 3 (out of range) and repeats of
// slot 0 sprinkled in.
std::vector<std::int64_t> make_ids(const Case& c, std::uint64_t seed) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(c.tokens * c.k));
  for (std::int64_t t = 0; t < c.tokens; ++t)
    for (int j = 0; j < c.k; ++j) {
      const double u = uniform01(seed, 5, static_cast<std::uint64_t>(t * c.k + j));
      std::int64_t e = static_cast<std::int64_t>(uniform01(seed, 6, static_cast<std::uint64_t>(t * c.k + j)) * c.experts);
      if (u < 0.1) e = -1;
      else if (u < 0.12) e = c.experts + 3;
      else if (u < 0.15 && j > 0) e = v[static_cast<std::size_t>(t * c.k)];
      v[static_cast<std::size_t>(t * c.k + j)] = e;
    }
  return v;
}

struct Counts {
  std::vector<int> slot;                      // [T * k]
  std::vector<long long> per_expert, per_rank;  // [E], [R]
  std::vector<int> flag;                      // [R * T]
  std::vector<unsigned> mask;                 // [R * chunks]
};

// The kernel's rules: an id outside [-1, E) or equal to an earlier slot's is -1; each kept slot
// counts for its expert, each token once for every rank owning one of its kept experts.
Counts cpu_counts(const Case& c, const std::vector<std::int64_t>& ids) {
  const int L = c.experts / c.ranks;
  const std::int64_t chunks = (c.tokens + 31) / 32;
  Counts out{std::vector<int>(ids.size()), std::vector<long long>(static_cast<std::size_t>(c.experts)),
             std::vector<long long>(static_cast<std::size_t>(c.ranks)),
             std::vector<int>(static_cast<std::size_t>(c.ranks * c.tokens)),
             std::vector<unsigned>(static_cast<std::size_t>(c.ranks * chunks))};
  for (std::int64_t t = 0; t < c.tokens; ++t)
    for (int j = 0; j < c.k; ++j) {
      const std::int64_t e = ids[static_cast<std::size_t>(t * c.k + j)];
      bool ok = e >= 0 && e < c.experts;
      for (int q = 0; ok && q < j; ++q) ok = ids[static_cast<std::size_t>(t * c.k + q)] != e;
      out.slot[static_cast<std::size_t>(t * c.k + j)] = ok ? static_cast<int>(e) : -1;
      if (!ok) continue;
      ++out.per_expert[static_cast<std::size_t>(e)];
      const int d = static_cast<int>(e) / L;
      int& f = out.flag[static_cast<std::size_t>(d * c.tokens + t)];
      if (f == 0) ++out.per_rank[static_cast<std::size_t>(d)];
      f = 1;
      out.mask[static_cast<std::size_t>(d * chunks + t / 32)] |= 1u << (t % 32);
    }
  return out;
}

TEST(CountRoutesGpu, MasksFlagsAndCountsMatchTheCpu) {
  if (!require_gpus(1)) return;
  cuda::init();
  const cuda::OwnedStream s;
  const Device dev = Device::cuda(0);
  const std::vector<Case> cases = {
      {"1 rank, 8 experts, k 4, 100 tokens", 1, 8, 4, 100, true},
      {"2 ranks, 64 experts, k 8, 4096 tokens", 2, 64, 8, 4096, true},
      {"8 ranks, 32 experts, k 3, 77 tokens, int32", 8, 32, 3, 77, false},
      {"32 ranks, 64 experts, k 8, 65 tokens (ballots, every lane a rank)", 32, 64, 8, 65, true},
      {"40 ranks, 80 experts, k 8, 300 tokens (atomics)", 40, 80, 8, 300, true},
      {"72 ranks, 144 experts, k 2, 33 tokens (atomics)", 72, 144, 2, 33, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<std::int64_t> ids = make_ids(c, 11);
    const Counts want = cpu_counts(c, ids);
    Tensor host_ids = Tensor::from_vector(ids, {c.tokens, c.k});
    if (!c.i64) host_ids = host_ids.to(DType::i32);
    const Tensor d_ids = cuda::to_device(host_ids, 0, s);
    const std::int64_t chunks = (c.tokens + 31) / 32;
    for (const bool masks : {false, true}) {
      SCOPED_TRACE(masks ? "masks" : "flags");
      const Tensor slot = Tensor::empty({c.tokens * c.k}, DType::i32, dev);
      const Tensor counts = Tensor::zeros({c.experts + c.ranks}, DType::i64, dev);
      const Tensor flag = Tensor::zeros({c.ranks * c.tokens}, DType::i32, dev);
      Tensor mask = Tensor::empty({c.ranks * chunks}, DType::i32, dev);
      FLEXEP_CUDA_CHECK(cudaMemsetAsync(mask.raw(), 0xab, mask.nbytes(), s));  // written whole, or it shows
      cuda::DeviceErrors errors(0);
      CountRoutesCall call;
      call.indices = d_ids.raw();
      call.indices_i64 = c.i64;
      call.tokens = c.tokens;
      call.k = c.k;
      call.experts = c.experts;
      call.local_experts = c.experts / c.ranks;
      call.ranks = c.ranks;
      call.slot_expert = slot.data<std::int32_t>();
      call.expert_counts = reinterpret_cast<long long*>(counts.raw());
      call.dest_counts = call.expert_counts + c.experts;
      if (masks) {
        call.dest_mask = reinterpret_cast<unsigned*>(mask.raw());
        call.mask_chunks = chunks;
      } else {
        call.dest_flag = flag.data<std::int32_t>();
      }
      call.errors = errors.record();
      launch_count_routes(call, s);
      EXPECT_EQ(host_vector<int>(slot, s), want.slot);
      const std::vector<long long> got = host_vector<long long>(counts, s);
      EXPECT_EQ(std::vector<long long>(got.begin(), got.begin() + c.experts), want.per_expert);
      EXPECT_EQ(std::vector<long long>(got.begin() + c.experts, got.end()), want.per_rank);
      if (masks)
        EXPECT_EQ(host_vector<unsigned>(mask, s), want.mask);
      else
        EXPECT_EQ(host_vector<int>(flag, s), want.flag);
      EXPECT_THROW(errors.check(s, "count"), ArgumentError);  // the ids out of range and the repeats
    }
  }
}

}  // namespace
