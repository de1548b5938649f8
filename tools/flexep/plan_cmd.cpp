// `flexep plan`: shows the dispatch plan of a synthetic routing: rows per rank, tokens per local
// expert, padding, drops and the bytes a dispatch moves (own rank and remote), as text or JSON.
#include <climits>
#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cli_checks.h"
#include "commands.h"
#include "progress.h"
#include "flexep/core/plan.h"
#include "flexep/core/synthetic_routing.h"

namespace flexep::tools {

namespace {
struct PlanArgs {
  int ranks = 2, experts = 64, topk = 8, hidden = 7168;
  long long tokens = 4096, pad_multiple = 1, budget = -1;
  std::string routing = "uniform";
  double zipf_s = 1.2;
  bool drop = false, json = false, quiet = false;
  long long seed = 1;
};

// Above this many routed slots (ranks x tokens x top-k; ~1 s on one core) the routing shows its
// progress on stderr.
constexpr double kProgressSlots = 5e7;
// A source rank's routing is drawn and counted this many routed slots at a time (65536 tokens at
// top-8, fewer at larger top-k): a step of the progress (a fraction of a second at 1024 experts),
// and the memory of one piece per worker.
constexpr std::int64_t kPieceSlots = std::int64_t{1} << 19;

void run(const PlanArgs& a) {
  RoutingSpec spec;
  spec.kind = parse_routing(a.routing, "--routing");
  spec.zipf_s = a.zipf_s;
  PlanParams p;
  p.ranks = a.ranks;
  p.experts = a.experts;
  p.pad_multiple = a.pad_multiple;
  if (a.budget >= 0) p.budget_rows = a.budget;
  p.overflow = a.drop ? OverflowPolicy::drop : OverflowPolicy::error;
  validate(p);
  // Every source rank's routing, on all cores.
  const auto R = static_cast<std::size_t>(a.ranks);
  std::vector<std::vector<std::int64_t>> per_rank_counts(R);
  std::vector<std::vector<std::int64_t>> to_all(R), to_remote(R);  // [source][destination]
  // One piece of source rank s's tokens [first, first + n): its expert counts and (token, destination
  // rank) pairs, what a deduplicating dispatch sends, added to the rank's totals.
  auto one_piece = [&](int s, std::int64_t first, std::int64_t n) {
    const TopK r = synthetic_topk(n, a.topk, a.experts, spec, static_cast<std::uint64_t>(a.seed), s, first);
    const std::vector<std::int64_t> piece_counts = expert_counts(r.indices, a.experts);
    std::vector<std::int64_t>& counts_s = per_rank_counts[static_cast<std::size_t>(s)];
    for (std::size_t e = 0; e < counts_s.size(); ++e) counts_s[e] += piece_counts[e];
    std::vector<std::int64_t>& all = to_all[static_cast<std::size_t>(s)];
    std::vector<std::int64_t>& remote = to_remote[static_cast<std::size_t>(s)];
    // A token's owners, once each: a rank's stamp is the last token that counted it (O(k) per
    // token; top-k reaches 65536).
    const std::int64_t* ids = r.indices.data<std::int64_t>();
    std::vector<std::int64_t> stamp(R, -1);
    for (std::int64_t t = 0; t < n; ++t)
      for (int j = 0; j < a.topk; ++j) {
        const auto d = static_cast<std::size_t>(p.owner(static_cast<int>(ids[t * a.topk + j])));
        if (stamp[d] == t) continue;
        stamp[d] = t;
        ++all[d];
        if (d != static_cast<std::size_t>(s)) ++remote[d];
      }
  };
  for (std::size_t s = 0; s < R; ++s) {
    per_rank_counts[s].assign(static_cast<std::size_t>(a.experts), 0);
    to_all[s].assign(R, 0);
    to_remote[s].assign(R, 0);
  }
  {
    // The pieces of every source rank, taken in order by all cores (each piece is independent; a
    // rank's pieces go to one worker at a time, so its totals need no lock).
    const std::int64_t piece_tokens = std::clamp<std::int64_t>(kPieceSlots / a.topk, 1, std::int64_t{1} << 16);
    const std::int64_t pieces_per_rank = std::max<std::int64_t>(1, (a.tokens + piece_tokens - 1) / piece_tokens);
    const std::int64_t pieces = pieces_per_rank * a.ranks;
    const unsigned workers = std::max(1u, std::min(std::thread::hardware_concurrency(), static_cast<unsigned>(R)));
    std::atomic<int> next_rank{0};
    std::vector<std::thread> pool;
    std::exception_ptr failure;
    std::mutex lock;  // the failure and the progress line
    const bool show = !a.quiet && static_cast<double>(a.ranks) * static_cast<double>(a.tokens) * a.topk > kProgressSlots;
    Progress progress(pieces, "plan: routing");
    if (show)
      fmt::print(stderr, "plan: {} source ranks x {} tokens x top-{} of {} experts to route, in {} pieces\n", a.ranks,
                 a.tokens, a.topk, a.experts, pieces);
    std::int64_t done = 0;
    for (unsigned w = 0; w < workers; ++w)
      pool.emplace_back([&] {
        try {
          for (int s = next_rank++; s < a.ranks; s = next_rank++)
            for (std::int64_t i = 0; i < pieces_per_rank; ++i) {
              const std::int64_t first = i * piece_tokens;
              one_piece(s, first, std::min<std::int64_t>(piece_tokens, a.tokens - first));
              const std::lock_guard<std::mutex> hold(lock);
              if (show) progress.update(++done, fmt::format("pieces of up to {} tokens", piece_tokens));
            }
        } catch (...) {
          const std::lock_guard<std::mutex> hold(lock);
          failure = std::current_exception();
        }
      });
    for (std::thread& t : pool) t.join();
    if (failure) std::rethrow_exception(failure);
  }
  std::vector<std::int64_t> counts;
  std::vector<std::int64_t> unique_remote(R, 0), unique_all(R, 0);
  for (std::size_t s = 0; s < R; ++s) {
    counts.insert(counts.end(), per_rank_counts[s].begin(), per_rank_counts[s].end());
    for (std::size_t d = 0; d < R; ++d) unique_all[d] += to_all[s][d], unique_remote[d] += to_remote[s][d];
  }
  const DispatchPlan plan = DispatchPlan::build(counts, p);
  nlohmann::json j;
  j["ranks"] = a.ranks;
  j["experts"] = a.experts;
  j["topk"] = a.topk;
  j["tokens_per_rank"] = a.tokens;
  j["routing"] = a.routing;
  for (int r = 0; r < a.ranks; ++r) {
    const RankLayout& lay = plan.ranks[static_cast<std::size_t>(r)];
    j["rank"][r] = {{"rows", lay.out_rows}, {"required_rows", lay.required_rows}, {"dropped", lay.dropped},
                    {"tokens_per_expert", lay.tokens_per_expert},
                    {"received_token_rows", unique_all[static_cast<std::size_t>(r)]},
                    {"received_remote_token_rows", unique_remote[static_cast<std::size_t>(r)]}};
  }
  if (a.json) {
    fmt::print("{}\n", j.dump(2));
    return;
  }
  fmt::print("plan: {} ranks, {} experts ({} per rank), top-{}, {} tokens per rank, {} routing, pad {}{}\n",
             a.ranks, a.experts, p.local_experts(), a.topk, a.tokens, a.routing, a.pad_multiple,
             p.budget_rows ? fmt::format(", budget {} rows ({})", *p.budget_rows, a.drop ? "drop" : "error") : "");
  const double row_mb = a.hidden * 2.0 / 1e6;
  for (int r = 0; r < a.ranks; ++r) {
    const RankLayout& lay = plan.ranks[static_cast<std::size_t>(r)];
    std::int64_t mn = INT64_MAX, mx = 0;
    for (auto c : lay.tokens_per_expert) mn = std::min(mn, c), mx = std::max(mx, c);
    // The expert-major output is what a fused dispatch writes into HBM (every token once per local
    // expert): at top-8 of 64 experts it is 4x the token rows a rank receives.
    fmt::print("  rank {}: {} expert rows (needs {}), dropped {}, tokens/expert min {} max {}; receives {} token "
               "rows ({} remote, {:.1f} MB at H={} bf16); expert-major output {:.1f} MB\n",
               r, lay.out_rows, lay.required_rows, lay.dropped, mn, mx, unique_all[static_cast<std::size_t>(r)],
               unique_remote[static_cast<std::size_t>(r)], unique_remote[static_cast<std::size_t>(r)] * row_mb, a.hidden,
               lay.out_rows * row_mb);
  }
}
}  // namespace

void add_plan_command(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand("plan", "Show the dispatch plan of a synthetic routing");
  cmd->add_option("--ranks", a->ranks, "Expert-parallel ranks")->check(whole_number(1, 1024));
  cmd->add_option("--experts", a->experts, "Routed experts (divisible by ranks)")->check(whole_number(1, 1 << 16));
  cmd->add_option("--topk", a->topk, "Experts per token")->check(whole_number(1, 1 << 16));
  cmd->add_option("--tokens", a->tokens, "Tokens per rank")->check(whole_number(0, 1 << 30));
  cmd->add_option("--hidden", a->hidden, "Hidden size (for bytes)")->check(whole_number(1, 1 << 20));
  cmd->add_option("--routing", a->routing, "uniform, zipf or hot");
  CLI::Option* zipf_s = cmd->add_option("--zipf-s", a->zipf_s, "Zipf exponent (with --routing zipf)");
  cmd->add_option("--pad-multiple", a->pad_multiple, "Pad each expert group to a multiple")
      ->check(whole_number(1, 1 << 16));
  cmd->add_option("--budget", a->budget, "Budget mode: output rows per rank")
      ->check(whole_number(0, (1LL << 31) - 1));
  cmd->add_flag("--drop", a->drop, "Drop rows over the budget instead of failing (with --budget)");
  cmd->add_option("--seed", a->seed, "Routing seed")->check(whole_number(0, LLONG_MAX));
  cmd->add_flag("--json", a->json, "Print JSON");
  cmd->add_flag("--quiet", a->quiet, "No progress output (shown on stderr for long plans)");
  cmd->callback([a, zipf_s] {
    // Options that only mean something beside another: refused rather than ignored.
    FLEXEP_CHECK_ARG(!a->drop || a->budget >= 0, "--drop", "drops rows over the budget; give --budget too");
    FLEXEP_CHECK_ARG(zipf_s->count() == 0 || a->routing == "zipf", "--zipf-s", "is the exponent of --routing zipf, "
                     "but the routing is '", a->routing, "'");
    run(*a);
  });
}

}  // namespace flexep::tools
