// Soak of the host backend: 10,000 dispatch + combine calls with random shapes, routings (uniform,
// all tokens to one expert, none), dtypes, token counts per rank (0 included), padding, budget mode
// with overflow errors and drops, and the multihot form, on 1 to 4 simulated ranks; every call
// checked against the independent reference of host_dispatch_reference.h, every overflow raised on
// every rank with the group usable afterwards, and the process's resident memory flat across the run.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <unistd.h>

#include "cpu/host_dispatch_reference.h"

using namespace flexep;
using namespace flexep::testing;

namespace {

// AddressSanitizer keeps freed memory in a quarantine of up to 256 MB before reusing it, so resident
// memory grows by that much in any long run; there LeakSanitizer (scripts/test.sh: detect_leaks=1)
// reports what was never freed.
#if defined(__SANITIZE_ADDRESS__)
constexpr std::int64_t kAllowedGrowth = (256ll + 32) << 20;
#else
constexpr std::int64_t kAllowedGrowth = 32ll << 20;
#endif

// Resident memory of this process, bytes (Linux: /proc/self/statm's second field, in pages).
std::int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

Tensor random_rows(const Tensor& like, std::mt19937& rng) {
  std::normal_distribution<double> normal;
  Tensor y = Tensor::empty(like.shape(), DType::f64);
  for (std::int64_t i = 0; i < y.numel(); ++i) y.data<double>()[i] = normal(rng);
  return y.to(like.dtype());
}

struct Call {
  Spec spec;
  DispatchOptions options;
  bool multihot = false;
};

Call random_call(int R, int E, std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Call c;
  Spec& s = c.spec;
  s.ranks = R;
  s.experts = E;
  s.hidden = std::vector<std::int64_t>{1, 3, 8, 17, 32}[static_cast<std::size_t>(pick(0, 4))];
  s.topk = pick(1, std::min(E, 6));
  s.tokens.clear();
  for (int r = 0; r < R; ++r) s.tokens.push_back(pick(0, 3) == 0 ? 0 : pick(1, 24));
  switch (pick(0, 3)) {
    case 0: s.only_expert = pick(0, E - 1); break;  // every token to one expert
    case 1: s.p_none = 1.0; break;                  // no token goes anywhere
    default: s.p_none = pick(0, 50) / 100.0;        // uniform, some slots -1
  }
  const int dtype = pick(0, 2);
  s.hidden_dtype = dtype == 0 ? DType::bf16 : dtype == 1 ? DType::f32 : DType::f64;
  s.weight_dtype = dtype == 2 ? DType::f64 : DType::f32;
  s.index_dtype = pick(0, 1) ? DType::i32 : DType::i64;
  s.seed = static_cast<std::uint32_t>(rng());
  c.options.pad_multiple = std::vector<std::int64_t>{1, 2, 4}[static_cast<std::size_t>(pick(0, 2))];
  c.multihot = pick(0, 4) == 0;
  return c;
}

// Budget mode for a fraction of the calls: a budget between half and 1.5 times the busiest
// receiver's rows, overflow error or drop.
void maybe_budget(Call& c, const std::vector<RankInput>& in, std::mt19937& rng) {
  if (std::uniform_int_distribution<int>(0, 9)(rng) >= 4) return;
  const Reference blocking = reference_dispatch(in, c.spec.experts, c.options);
  std::int64_t most = 0;
  for (std::int64_t n : blocking.required_rows) most = std::max(most, n);
  const double f = std::uniform_real_distribution<double>(0.5, 1.5)(rng);
  const std::int64_t pad = c.options.pad_multiple;
  c.options.mode = DispatchMode::budget;
  c.options.budget_rows = round_up(static_cast<std::int64_t>(static_cast<double>(most) * f), pad);
  c.options.overflow = std::uniform_int_distribution<int>(0, 1)(rng) ? OverflowPolicy::drop : OverflowPolicy::error;
}

}  // namespace

TEST(HostSoak, TenThousandCallsMatchTheReferenceWithFlatMemory) {
  constexpr int kCalls = 10000;
  struct Shape {
    int ranks, experts;
  };
  const Shape shapes[] = {{1, 4}, {2, 8}, {3, 6}, {4, 16}};
  std::vector<std::unique_ptr<Group>> groups;
  for (const Shape& s : shapes) groups.push_back(std::make_unique<Group>(s.ranks, s.experts, 30.0));
  std::mt19937 rng(20261206);
  std::int64_t resident_after_warmup = 0, overflows = 0, drops = 0, checked = 0;
  for (int call = 0; call < kCalls; ++call) {
    const std::size_t gi = static_cast<std::size_t>(call) % groups.size();
    Group& g = *groups[gi];
    Call c = random_call(shapes[gi].ranks, shapes[gi].experts, rng);
    const std::vector<RankInput> in = make_inputs(c.spec);
    maybe_budget(c, in, rng);
    const Reference ref = reference_dispatch(in, c.spec.experts, c.options);
    bool overflow = false;
    for (std::int64_t n : ref.required_rows)
      overflow = overflow || (c.options.mode == DispatchMode::budget && c.options.overflow == OverflowPolicy::error &&
                              n > c.options.budget_rows);
    const int R = c.spec.ranks;
    std::vector<DispatchResult> results(static_cast<std::size_t>(R));
    std::vector<Tensor> rows(static_cast<std::size_t>(R)), combined(static_cast<std::size_t>(R));
    std::vector<std::mt19937> rank_rng;
    for (int r = 0; r < R; ++r) rank_rng.emplace_back(c.spec.seed + static_cast<unsigned>(r));
    const auto errors = g.run([&](int r, TokenDispatcher& d) {
      const std::size_t i = static_cast<std::size_t>(r);
      results[i] = d.dispatch(c.multihot ? in[i].multihot() : in[i].topk(), c.options);
      rows[i] = random_rows(results[i].tokens, rank_rng[i]);
      combined[i] = d.combine(results[i].handle, rows[i]);
    });
    const std::string where = "call " + std::to_string(call) + " (seed " + std::to_string(c.spec.seed) + ")";
    if (overflow) {
      ++overflows;
      ASSERT_TRUE(all_threw<Error>(errors, [](const Error& e) {
        return std::string(e.what()).find("budget_rows") != std::string::npos;
      })) << where;
      ASSERT_FALSE(g.world->broken()) << where;
      continue;
    }
    ASSERT_TRUE(all_ok(errors)) << where;
    for (int r = 0; r < R; ++r) {
      const std::size_t i = static_cast<std::size_t>(r);
      ASSERT_TRUE(same_bits(results[i].tokens, ref.tokens[i])) << where << ", rank " << r << ": tokens";
      ASSERT_TRUE(same_bits(results[i].token_probs, ref.probs[i])) << where << ", rank " << r << ": probs";
      const std::int64_t* tpe = results[i].tokens_per_expert.data<std::int64_t>();
      ASSERT_EQ(std::vector<std::int64_t>(tpe, tpe + results[i].tokens_per_expert.numel()), ref.tpe[i]) << where;
      ASSERT_EQ(results[i].dropped, ref.dropped[i]) << where;
      drops += ref.dropped[i];
      ASSERT_TRUE(same_bits(combined[i], reference_combine(in, ref, rows, r))) << where << ", rank " << r << ": combine";
    }
    ++checked;
    if (call == 999) resident_after_warmup = resident_bytes();
  }
  // Every kind of call happened, and memory stayed flat after the first thousand calls (the
  // allocator's caches are warm by then; a leak of one small tensor per call would show as MBs).
  EXPECT_GT(overflows, 100);
  EXPECT_GT(drops, 100);
  EXPECT_GT(checked, 8000);
  const std::int64_t growth = resident_bytes() - resident_after_warmup;
  EXPECT_LT(growth, kAllowedGrowth) << "resident memory grew by " << growth << " bytes over " << kCalls - 1000
                                    << " calls";
}
