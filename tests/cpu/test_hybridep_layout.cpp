// The host-side logic of the hybridep backend (src/dispatch/hybridep/kernels/layout_math.h, layout.h), which
// needs no GPU, and an emulation of its kernels' algorithm in plain loops:
//   - receiver_layout() and source_begin() are core/plan.cpp's DispatchPlan::build, field by field;
//   - the whole dispatch, emulated with the kernels' own helpers (the single-GPU plan's stable ranks,
//     the count matrix, every receiver's layout, staged records sorted by row, placement of each
//     record's row and probs on the receiver) gives exactly the host backend's tokens, probs,
//     tokens_per_expert and drops; the emulated combine (level 1 over record order, level 2 over
//     ascending owner rank, bf16 roundings in between), dispatch_backward (prob grads through the
//     slot entries) and combine_backward give exactly the host backend's results;
//   - headers, the agreement rule, abort reasons and the buffer geometry.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/dispatch_inputs.h"
#include "cpu/host_ranks.h"
#include "cpu/same_bytes.h"
#include "flexep/comm/host_world.h"
#include "flexep/core/error.h"
#include "flexep/core/plan.h"
#include "flexep/core/random.h"
#include "flexep/core/routing.h"
#include "flexep/core/synthetic_routing.h"
#include "flexep/dispatch/host.h"
// Internal headers of the backend (pure C++, no CUDA); the tests' include path has no src/.
#include "dispatch/hybridep/dispatcher/layout.h"
#include "dispatch/hybridep/kernels/layout_math.h"

namespace flexep::hybridep {
namespace {

using testing::all_ok;
using testing::drop_some_slots;
using testing::random_tensor;
using testing::required_rows_of;
using testing::same_bytes;
using testing::run_ranks;
using testing::wide_range_rows;

std::string what_of(const std::exception_ptr& e) {
  if (!e) return "(none)";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

// ---- receiver_layout == DispatchPlan::build ---------------------------------------------------------

struct CountMatrix {
  const std::vector<std::int64_t>* counts;
  int experts;
  long long operator()(int s, int e) const { return (*counts)[static_cast<std::size_t>(s) * experts + e]; }
};

std::vector<std::int64_t> random_counts(int R, int E, std::uint64_t seed, int max_count) {
  std::vector<std::int64_t> c(static_cast<std::size_t>(R) * E);
  for (std::size_t i = 0; i < c.size(); ++i) {
    const double u = uniform01(seed, 7, i);
    c[i] = u < 0.2 ? 0 : static_cast<std::int64_t>(uniform01(seed, 8, i) * max_count);
  }
  return c;
}

TEST(HybridEpLayout, ReceiverLayoutIsThePlan) {
  int cases = 0;
  for (int R : {1, 2, 3, 4})
    for (int L : {1, 2, 5, 32})
      for (std::int64_t pad : {1, 16, 128})
        for (int mode = 0; mode < 4; ++mode) {  // blocking, budget with room, budget drop, budget overflow error
          const int E = R * L;
          const auto counts = random_counts(R, E, 100 + R * 1000 + L * 10 + pad + mode, 40);
          PlanParams p;
          p.ranks = R;
          p.experts = E;
          p.pad_multiple = pad;
          std::int64_t most = 0;
          {
            const DispatchPlan full = DispatchPlan::build(counts, p);
            for (const auto& lay : full.ranks) most = std::max(most, lay.required_rows);
          }
          if (mode == 1) p.budget_rows = (most + 3 * pad) / pad * pad;
          if (mode >= 2) p.budget_rows = most / 2 / pad * pad;
          p.overflow = mode == 3 ? OverflowPolicy::error : OverflowPolicy::drop;
          const LayoutParams lp{R, E, pad, p.budget_rows ? *p.budget_rows : -1, p.overflow == OverflowPolicy::drop};
          const CountMatrix cm{&counts, E};
          bool any_overflow = false;
          std::vector<ReceiverTotals> totals;
          std::vector<long long> begin(E), kept(E), tpe(E);
          for (int d = 0; d < R; ++d) {
            totals.push_back(receiver_layout(cm, d, lp, begin.data() + d * L, kept.data() + d * L, tpe.data() + d * L));
            any_overflow |= totals.back().overflow;
          }
          SCOPED_TRACE("R=" + std::to_string(R) + " L=" + std::to_string(L) + " pad=" + std::to_string(pad) +
                       " mode=" + std::to_string(mode));
          if (mode == 3) {
            EXPECT_TRUE(any_overflow || most <= *p.budget_rows);
            if (any_overflow) {
              EXPECT_THROW(DispatchPlan::build(counts, p), Error);
            }
            continue;
          }
          ASSERT_FALSE(any_overflow);
          const DispatchPlan plan = DispatchPlan::build(counts, p);
          for (int d = 0; d < R; ++d) {
            const RankLayout& lay = plan.ranks[static_cast<std::size_t>(d)];
            EXPECT_EQ(totals[d].required, lay.required_rows);
            EXPECT_EQ(totals[d].out_rows, lay.out_rows);
            EXPECT_EQ(totals[d].dropped, lay.dropped);
            long long used = 0;
            for (int le = 0; le < L; ++le) {
              const int e = d * L + le;
              EXPECT_EQ(begin[e], lay.expert_begin[le]);
              EXPECT_EQ(kept[e], lay.kept_rows[le]);
              EXPECT_EQ(tpe[e], lay.tokens_per_expert[le]);
              used += lay.tokens_per_expert[le];
              for (int s = 0; s < R; ++s)
                EXPECT_EQ(source_begin(cm, e, s, begin[e]), lay.source_begin[static_cast<std::size_t>(le) * R + s]);
            }
            EXPECT_EQ(totals[d].used, used);
          }
          ++cases;
        }
  EXPECT_GT(cases, 100);
}

// cut_group, group by group from a running sum of the padded groups (as deepep's notify kernel
// uses it, with a block scan for the sum), gives DispatchPlan::build's kept pairs, tokens_per_expert
// and drops under the drop policy and within the budget.
TEST(HybridEpLayout, CutGroupIsThePlansBudgetCut) {
  int cases = 0;
  for (int R : {1, 2, 3})
    for (int L : {1, 3, 8, 32})
      for (std::int64_t pad : {1, 4, 16})
        for (double fraction : {0.0, 0.3, 0.7, 1.0, 1.5}) {
          const int E = R * L;
          const auto counts = random_counts(R, E, 7000 + R * 100 + L * 10 + pad, 40);
          PlanParams p;
          p.ranks = R;
          p.experts = E;
          p.pad_multiple = pad;
          std::int64_t most = 0;
          for (const auto& lay : DispatchPlan::build(counts, p).ranks) most = std::max(most, lay.required_rows);
          p.budget_rows = static_cast<std::int64_t>(static_cast<double>(most) * fraction) / pad * pad;
          p.overflow = OverflowPolicy::drop;
          const DispatchPlan plan = DispatchPlan::build(counts, p);
          const CountMatrix cm{&counts, E};
          SCOPED_TRACE("R=" + std::to_string(R) + " L=" + std::to_string(L) + " pad=" + std::to_string(pad) +
                       " budget=" + std::to_string(*p.budget_rows));
          for (int d = 0; d < R; ++d) {
            const RankLayout& lay = plan.ranks[static_cast<std::size_t>(d)];
            long long begin = 0, dropped = 0;
            for (int le = 0; le < L; ++le) {
              const long long real = group_pairs(cm, d * L + le, R);
              const GroupCut cut = cut_group(begin, real, *p.budget_rows, pad);
              EXPECT_EQ(cut.kept, lay.kept_rows[static_cast<std::size_t>(le)]) << "expert " << le;
              EXPECT_EQ(cut.len, lay.tokens_per_expert[static_cast<std::size_t>(le)]) << "expert " << le;
              dropped += real - cut.kept;
              begin += round_up(real, pad);
            }
            EXPECT_EQ(dropped, lay.dropped);
          }
          ++cases;
        }
  EXPECT_EQ(cases, 3 * 4 * 3 * 5);
}

// The kernels' owner of an expert (OwnerOf: a multiply-high instead of a division) is e / L for
// every expert id and every experts-per-rank count the kernels accept.
TEST(HybridEpLayout, OwnerOfIsTheDivisionForEveryExpertCount) {
  int wrong = 0;
  for (int L = 1; L <= kMaxExperts; ++L) {
    const OwnerOf owner = OwnerOf::for_local_experts(L);
    for (int e = 0; e < kMaxExperts; ++e)
      if (owner(e) != e / L && ++wrong <= 5) ADD_FAILURE() << "e = " << e << ", L = " << L << ": " << owner(e);
  }
  EXPECT_EQ(wrong, 0);
}

TEST(HybridEpLayout, ChunksAndRecordSizes) {
  EXPECT_EQ(num_chunks(0), 1);  // a rank without tokens still exchanges one flag per call
  EXPECT_EQ(num_chunks(1), 1);
  EXPECT_EQ(num_chunks(kChunkTokens), 1);
  EXPECT_EQ(num_chunks(kChunkTokens + 1), 2);
  EXPECT_EQ(record_bytes(1), 16);
  EXPECT_EQ(record_bytes(8), 80);
  EXPECT_EQ(record_words(1), 1);  // {epoch, n, row0, prob0}: one 16-byte word
  EXPECT_EQ(record_words(2), 2);
  EXPECT_EQ(record_words(3), 2);
  std::vector<unsigned char> rec(static_cast<std::size_t>(record_bytes(4)));
  record_clear(rec.data());
  for (int row : {40, 7, 19, 3}) EXPECT_TRUE(record_insert(rec.data(), 4, row, static_cast<float>(row)));
  EXPECT_FALSE(record_insert(rec.data(), 4, 100, 0.f));
  const RecordEntry* e = record_entries(rec.data());
  EXPECT_EQ(e[0].row, 3);
  EXPECT_EQ(e[1].row, 7);
  EXPECT_EQ(e[2].row, 19);
  EXPECT_EQ(e[3].row, 40);
  EXPECT_EQ(e[2].prob, 19.f);
  EXPECT_EQ(record_find(rec.data(), 19), 2);
  EXPECT_EQ(record_find(rec.data(), 20), -1);
}

// ---- the kernels' algorithm, emulated, against the host backend -------------------------------------

struct Config {
  std::string name;
  int experts_per_rank = 2, k = 1, slots = 0;  // slots: the buffer's slots per token (0 = k, or E for multihot)
  std::int64_t hidden = 8;
  std::vector<std::int64_t> tokens;  // per rank
  RoutingKind routing = RoutingKind::uniform;
  std::int64_t pad = 1;
  bool budget = false;
  double budget_fraction = 1.0;
  bool multihot = false;
};

struct Inputs {
  Tensor hidden, indices, weights, routing_map, probs;
};

Inputs make_inputs(const Config& c, int R, int r) {
  const int E = c.experts_per_rank * R;
  const std::int64_t T = c.tokens[static_cast<std::size_t>(r)];
  RoutingSpec spec;
  spec.kind = c.routing;
  spec.hot_expert = E - 1;
  TopK tk = synthetic_topk(T, c.k, E, spec, 77, r);
  drop_some_slots(tk.indices);
  Inputs in;
  in.hidden = random_tensor({T, c.hidden}, DType::bf16, 5, "hidden", r);
  in.indices = tk.indices;
  in.weights = tk.weights;
  const Multihot mh = topk_to_multihot(tk.indices, tk.weights, E);
  in.routing_map = mh.routing_map;
  in.probs = mh.probs;
  return in;
}

struct Outputs {
  Tensor tokens, probs, tpe;
  std::int64_t dropped = 0;
  Tensor combined, grad_hidden, grad_weights, grad_expert_out;
};

// The per-rank tensors combine and the backwards take (same on both sides).
// Wide-range rows: the emulated combine's order of additions is checked, not only its addends.
Tensor expert_out_of(std::int64_t N, std::int64_t H, int r) { return wide_range_rows(N, H, 6, "eo", r); }
Tensor grad_out_of(std::int64_t T, std::int64_t H, int r) { return random_tensor({T, H}, DType::bf16, 7, "go", r); }
Tensor grad_tokens_of(std::int64_t N, std::int64_t H, int r) { return random_tensor({N, H}, DType::bf16, 8, "gt", r); }
Tensor grad_probs_of(std::int64_t N, int r) { return random_tensor({N}, DType::f32, 9, "gp", r); }

DispatchOptions options_of(const Config& c, int R) {
  DispatchOptions o;
  o.pad_multiple = c.pad;
  if (c.budget) {
    std::vector<Tensor> indices;
    for (int r = 0; r < R; ++r) indices.push_back(make_inputs(c, R, r).indices);
    std::int64_t most = 0;
    for (std::int64_t n : required_rows_of(indices, c.experts_per_rank * R, c.pad)) most = std::max(most, n);
    o.mode = DispatchMode::budget;
    o.budget_rows = static_cast<std::int64_t>(static_cast<double>(most) * c.budget_fraction) / c.pad * c.pad;
    o.overflow = OverflowPolicy::drop;
  }
  return o;
}

std::vector<Outputs> run_host(const Config& c, int R) {
  auto world = std::make_shared<HostWorld>(R, 60.0);
  std::vector<Outputs> outs(static_cast<std::size_t>(R));
  const DispatchOptions o = options_of(c, R);
  const auto errors = run_ranks(R, [&](int r) {
    auto d = make_host_dispatcher(world, r, c.experts_per_rank * R);
    const Inputs in = make_inputs(c, R, r);
    DispatchInput di;
    di.hidden = in.hidden;
    if (c.multihot) {
      di.routing_map = in.routing_map;
      di.probs = in.probs;
    } else {
      di.indices = in.indices;
      di.weights = in.weights;
    }
    DispatchResult res = d->dispatch(di, o);
    Outputs& out = outs[static_cast<std::size_t>(r)];
    out.tokens = res.tokens;
    out.probs = res.token_probs;
    out.tpe = res.tokens_per_expert;
    out.dropped = res.dropped;
    const std::int64_t N = res.tokens.size(0), T = in.hidden.size(0), H = c.hidden;
    out.combined = d->combine(res.handle, expert_out_of(N, H, r));
    out.grad_expert_out = d->combine_backward(res.handle, grad_out_of(T, H, r));
    DispatchGrads g = d->dispatch_backward(res.handle, grad_tokens_of(N, H, r), grad_probs_of(N, r));
    out.grad_hidden = g.hidden;
    out.grad_weights = g.weights;
  });
  EXPECT_TRUE(all_ok(errors)) << c.name;
  return outs;
}

// One rank's slots after the GPU's routing step: the top-k form as given, or the multihot form as
// ascending experts in `slots` slots (multihot_slots_kernel).
struct Slots {
  int k = 1;
  std::vector<int> expert;                     // [T * k], -1 = none
  std::vector<float> weight;                   // [T * k]
  std::vector<int> local_row;                  // the single-GPU plan (pad 1): prefix of the expert's count + rank
  std::vector<long long> local_begin, counts;  // [E]
};

Slots slots_of(const Config& c, const Inputs& in, int E) {
  Slots s;
  const std::int64_t T = in.hidden.size(0);
  if (c.multihot) {
    s.k = c.slots > 0 ? c.slots : E;
    s.expert.assign(static_cast<std::size_t>(T * s.k), -1);
    s.weight.assign(static_cast<std::size_t>(T * s.k), 0.f);
    for (std::int64_t t = 0; t < T; ++t) {
      int j = 0;
      for (int e = 0; e < E; ++e)
        if (in.routing_map.data<bool>()[t * E + e]) {
          EXPECT_LT(j, s.k) << "the test's routing exceeds the slots";
          s.expert[static_cast<std::size_t>(t * s.k + j)] = e;
          s.weight[static_cast<std::size_t>(t * s.k + j)] = in.probs.data<float>()[t * E + e];
          ++j;
        }
    }
  } else {
    s.k = c.k;
    for (std::int64_t i = 0; i < T * c.k; ++i) {
      s.expert.push_back(static_cast<int>(in.indices.data<std::int64_t>()[i]));
      s.weight.push_back(in.weights.data<float>()[i]);
    }
  }
  // Stable sort by expert: the pairs of expert e in (token, slot) order.
  s.counts.assign(static_cast<std::size_t>(E), 0);
  for (int e : s.expert)
    if (e >= 0) ++s.counts[static_cast<std::size_t>(e)];
  s.local_begin.assign(static_cast<std::size_t>(E), 0);
  for (int e = 1; e < E; ++e) s.local_begin[e] = s.local_begin[e - 1] + s.counts[e - 1];
  std::vector<long long> next = s.local_begin;
  for (int e : s.expert) s.local_row.push_back(e >= 0 ? static_cast<int>(next[static_cast<std::size_t>(e)]++) : -1);
  return s;
}

float f(bf16 x) { return x.to_float(); }

std::vector<Outputs> emulate(const Config& c, int R) {
  const int E = c.experts_per_rank * R, L = c.experts_per_rank;
  const std::int64_t H = c.hidden;
  const DispatchOptions o = options_of(c, R);
  std::vector<Inputs> in;
  std::vector<Slots> sl;
  std::vector<std::int64_t> counts;
  for (int r = 0; r < R; ++r) {
    in.push_back(make_inputs(c, R, r));
    sl.push_back(slots_of(c, in.back(), E));
    counts.insert(counts.end(), sl.back().counts.begin(), sl.back().counts.end());
  }
  const int width = std::min(c.multihot ? (c.slots > 0 ? c.slots : E) : c.k, L);
  const int rec_bytes = record_bytes(width);

  // Every rank computes every receiver's layout from the same counts (preprocess step 4).
  const CountMatrix cm{&counts, E};
  const LayoutParams lp{R, E, c.pad, o.mode == DispatchMode::budget ? o.budget_rows : -1,
                        o.overflow == OverflowPolicy::drop};
  std::vector<long long> begin(E), kept(E), tpe(E);
  std::vector<ReceiverTotals> totals;
  for (int d = 0; d < R; ++d) {
    totals.push_back(receiver_layout(cm, d, lp, begin.data() + d * L, kept.data() + d * L, tpe.data() + d * L));
    EXPECT_FALSE(totals.back().overflow);
  }

  // Senders: staged records [d][t] and slot entries (preprocess step 5).
  std::vector<std::vector<unsigned char>> staging(static_cast<std::size_t>(R));
  std::vector<std::vector<int>> slot_entry(static_cast<std::size_t>(R));
  for (int s = 0; s < R; ++s) {
    const std::int64_t T = in[s].hidden.size(0);
    const Slots& x = sl[s];
    staging[s].assign(static_cast<std::size_t>(R * T * rec_bytes), 0xAB);  // garbage until cleared
    auto rec = [&](int d, std::int64_t t) { return staging[s].data() + (d * T + t) * rec_bytes; };
    auto dest_row = [&](std::int64_t i) {
      const int e = x.expert[i];
      if (x.local_row[i] < 0) return -1LL;
      return slot_destination_row(x.local_row[i], x.local_begin[e], source_begin(cm, e, s, begin[e]),
                                  begin[e] + kept[e]);
    };
    slot_entry[s].assign(static_cast<std::size_t>(T * x.k), -1);
    for (std::int64_t t = 0; t < T; ++t) {
      for (int d = 0; d < R; ++d) record_clear(rec(d, t));
      for (int j = 0; j < x.k; ++j) {
        const std::int64_t i = t * x.k + j, row = dest_row(i);
        if (row >= 0) {
          EXPECT_TRUE(record_insert(rec(x.expert[i] / L, t), width, static_cast<int>(row), x.weight[i]));
        }
      }
      for (int j = 0; j < x.k; ++j) {
        const std::int64_t i = t * x.k + j, row = dest_row(i);
        if (row < 0) continue;
        const int d = x.expert[i] / L, q = record_find(rec(d, t), static_cast<int>(row));
        EXPECT_GE(q, 0);
        if (q >= 0) slot_entry[s][i] = d * width + q;
      }
    }
  }
  auto record = [&](int s, int d, std::int64_t t) {
    return staging[s].data() + (d * in[s].hidden.size(0) + t) * rec_bytes;
  };

  std::vector<Outputs> outs(static_cast<std::size_t>(R));
  // Receivers: rows and probs of every record, zero elsewhere (dispatch kernel).
  for (int d = 0; d < R; ++d) {
    Outputs& out = outs[d];
    const std::int64_t N = totals[d].out_rows;
    out.tokens = Tensor::zeros({N, H}, DType::bf16);
    out.probs = Tensor::zeros({N}, DType::f32);
    out.tpe = Tensor::from_vector(std::vector<std::int64_t>(tpe.begin() + d * L, tpe.begin() + (d + 1) * L), {L});
    out.dropped = totals[d].dropped;
    for (int s = 0; s < R; ++s)
      for (std::int64_t t = 0; t < in[s].hidden.size(0); ++t) {
        const unsigned char* r = record(s, d, t);
        for (unsigned q = 0; q < record_header(r)->n; ++q) {
          const RecordEntry& e = record_entries(r)[q];
          EXPECT_LT(e.row, N);
          std::memcpy(out.tokens.data<bf16>() + e.row * H, in[s].hidden.data<bf16>() + t * H, H * 2);
          out.probs.data<float>()[e.row] = e.prob;
        }
      }
  }
  // combine / dispatch_backward: level 1 on the owner in record order, level 2 on the source over
  // ascending owner rank (combine.cu). `own_first`: combine.cu's order on ranks 0
  // and 1, where the source's own partial is the first addend and the other owners follow in
  // ascending order (the claim that this gives the same bits is what the comparison checks).
  auto two_level = [&](const std::vector<Tensor>& rows, int s, bool own_first) {
    const std::int64_t T = in[s].hidden.size(0);
    Tensor out = Tensor::empty({T, H}, DType::bf16);
    std::vector<float> acc(static_cast<std::size_t>(H)), part(static_cast<std::size_t>(H));
    std::vector<int> order;
    for (std::int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      order.clear();
      const bool own = own_first && s <= 1 && record_header(record(s, s, t))->n > 0;
      if (own) order.push_back(s);
      for (int d = 0; d < R; ++d)
        if (!own || d != s) order.push_back(d);
      for (const int d : order) {
        const unsigned char* r = record(s, d, t);
        if (record_header(r)->n == 0) continue;
        std::fill(part.begin(), part.end(), 0.f);
        for (unsigned q = 0; q < record_header(r)->n; ++q)
          for (std::int64_t h = 0; h < H; ++h) part[h] += f(rows[d].data<bf16>()[record_entries(r)[q].row * H + h]);
        for (std::int64_t h = 0; h < H; ++h) acc[h] += bf16::from_float(part[h]).to_float();
      }
      for (std::int64_t h = 0; h < H; ++h) out.data<bf16>()[t * H + h] = bf16::from_float(acc[h]);
    }
    return out;
  };
  std::vector<Tensor> expert_out, grad_tokens, grad_probs;
  for (int d = 0; d < R; ++d) {
    const std::int64_t N = totals[d].out_rows;
    expert_out.push_back(expert_out_of(N, H, d));
    grad_tokens.push_back(grad_tokens_of(N, H, d));
    grad_probs.push_back(grad_probs_of(N, d));
  }
  for (int s = 0; s < R; ++s) {
    const std::int64_t T = in[s].hidden.size(0);
    const Slots& x = sl[s];
    outs[s].combined = two_level(expert_out, s, true);
    outs[s].grad_hidden = two_level(grad_tokens, s, false);
    // Prob grads: slot entry d * width + q -> the owner's grad_probs at that entry's row.
    outs[s].grad_weights = Tensor::zeros({T, c.multihot ? E : c.k}, DType::f32);
    for (std::int64_t i = 0; i < T * x.k; ++i) {
      const int entry = slot_entry[s][i];
      if (entry < 0) continue;
      const int d = entry / width, q = entry % width;
      const float g = grad_probs[d].data<float>()[record_entries(record(s, d, i / x.k))[q].row];
      if (c.multihot)
        outs[s].grad_weights.data<float>()[i / x.k * E + x.expert[i]] = g;
      else
        outs[s].grad_weights.data<float>()[i] = g;
    }
  }
  // combine_backward: every row of a record gets grad_out of its token; other rows zero.
  for (int d = 0; d < R; ++d) {
    Tensor g = Tensor::zeros({totals[d].out_rows, H}, DType::bf16);
    for (int s = 0; s < R; ++s) {
      const Tensor go = grad_out_of(in[s].hidden.size(0), H, s);
      for (std::int64_t t = 0; t < in[s].hidden.size(0); ++t) {
        const unsigned char* r = record(s, d, t);
        for (unsigned q = 0; q < record_header(r)->n; ++q)
          std::memcpy(g.data<bf16>() + record_entries(r)[q].row * H, go.data<bf16>() + t * H, H * 2);
      }
    }
    outs[d].grad_expert_out = g;
  }
  return outs;
}

void check_emulation(const Config& c, int R, bool expect_drops = false) {
  SCOPED_TRACE(c.name + ", R=" + std::to_string(R));
  const std::vector<Outputs> want = run_host(c, R), got = emulate(c, R);
  std::int64_t dropped = 0;
  for (const Outputs& o : want) dropped += o.dropped;
  if (expect_drops) {
    EXPECT_GT(dropped, 0) << "the case should drop pairs";
  }
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Outputs& w = want[r];
    const Outputs& g = got[r];
    EXPECT_TRUE(same_bytes(w.tokens, g.tokens)) << "tokens";
    EXPECT_TRUE(same_bytes(w.probs, g.probs)) << "token_probs";
    EXPECT_TRUE(same_bytes(w.tpe, g.tpe)) << "tokens_per_expert";
    EXPECT_EQ(w.dropped, g.dropped);
    EXPECT_TRUE(same_bytes(w.combined, g.combined)) << "combine";
    EXPECT_TRUE(same_bytes(w.grad_hidden, g.grad_hidden)) << "dispatch_backward hidden";
    EXPECT_TRUE(same_bytes(w.grad_weights, g.grad_weights)) << "dispatch_backward weights";
    EXPECT_TRUE(same_bytes(w.grad_expert_out, g.grad_expert_out)) << "combine_backward";
  }
}

Config config(std::string name, int L, int k, std::int64_t H, std::vector<std::int64_t> tokens,
              RoutingKind routing = RoutingKind::uniform, std::int64_t pad = 1) {
  Config c;
  c.name = std::move(name);
  c.experts_per_rank = L;
  c.k = k;
  c.hidden = H;
  c.tokens = std::move(tokens);
  c.routing = routing;
  c.pad = pad;
  return c;
}

TEST(HybridEpLayout, EmulatedKernelsMatchHostBackend) {
  for (int R : {1, 2, 3}) {
    check_emulation(config("uniform L=2 k=1", 2, 1, 8, {37, 0, 53}), R);
    check_emulation(config("uniform L=32 k=8 pad 16", 32, 8, 8, {300, 257, 0}, RoutingKind::uniform, 16), R);
    check_emulation(config("zipf L=16 k=8 pad 128", 16, 8, 16, {200, 0, 131}, RoutingKind::zipf, 128), R);
    check_emulation(config("hot L=1 k=1", 1, 1, 8, {100, 64, 0}, RoutingKind::hot), R);
    check_emulation(config("hot L=8 k=8 all to one expert", 8, 8, 8, {0, 90, 33}, RoutingKind::hot), R);
    check_emulation(config("no tokens anywhere", 2, 2, 8, {0, 0, 0}), R);
  }
}

TEST(HybridEpLayout, EmulatedMultihotAndBudgetMatchHostBackend) {
  for (int R : {2, 3}) {
    Config mh = config("multihot L=8 k=4", 8, 4, 8, {120, 7, 0}, RoutingKind::zipf, 16);
    mh.multihot = true;
    check_emulation(mh, R);
    mh.name = "multihot in 4 slots";
    mh.slots = 4;
    check_emulation(mh, R);
    Config roomy = config("budget with room", 8, 4, 8, {150, 40, 3}, RoutingKind::zipf, 16);
    roomy.budget = true;
    roomy.budget_fraction = 1.5;
    check_emulation(roomy, R);
    Config drop = roomy;
    drop.name = "budget drop";
    drop.budget_fraction = 0.4;
    check_emulation(drop, R, true);
    Config drop_hot = config("budget drop hot pad 128", 4, 2, 8, {300, 0, 77}, RoutingKind::hot, 128);
    drop_hot.budget = true;
    drop_hot.budget_fraction = 0.3;
    check_emulation(drop_hot, R, true);
  }
}

// ---- headers, agreement and abort reasons ---------------------------------------------------------------

RankHeader header(int E, std::int64_t T) {
  RankHeader h;
  h.experts = E;
  h.hidden = 64;
  h.topk = 2;
  h.tokens = T;
  return h;
}

Snapshot snapshot_of(const std::vector<RankHeader>& headers, const std::vector<std::int64_t>& counts, int E) {
  const std::size_t slot_words = word::count + static_cast<std::size_t>(E) + 3;  // slots are padded
  std::vector<long long> words(headers.size() * slot_words, 0);
  for (std::size_t r = 0; r < headers.size(); ++r) {
    const auto w = encode(headers[r]);
    std::copy(w.begin(), w.end(), words.begin() + static_cast<std::ptrdiff_t>(r * slot_words));
    for (int e = 0; e < E; ++e) words[r * slot_words + word::count + e] = counts[r * E + e];
  }
  return parse_snapshot(words, static_cast<int>(headers.size()), E, slot_words);
}

TEST(HybridEpLayout, HeadersRoundTripAndAgree) {
  RankHeader h = header(8, 33);
  h.failed = true;
  h.argument = "weights";
  h.mode = DispatchMode::budget;
  h.budget_rows = 96;
  h.overflow = OverflowPolicy::drop;
  h.pad_multiple = 16;
  h.multihot = true;
  const RankHeader back = decode(encode(h).data());
  EXPECT_EQ(back.failed, true);
  EXPECT_EQ(back.argument, "weights");
  EXPECT_EQ(back.mode, DispatchMode::budget);
  EXPECT_EQ(back.budget_rows, 96);
  EXPECT_EQ(back.overflow, OverflowPolicy::drop);
  EXPECT_EQ(back.pad_multiple, 16);
  EXPECT_TRUE(back.multihot);
  EXPECT_EQ(back.tokens, 33);

  // The device's agreement rule and the host's messages decide alike.
  const auto base = encode(header(8, 10));
  auto differs = [&](auto change) {
    RankHeader other = header(8, 20);  // T may differ
    change(other);
    return !header_agrees(base.data(), encode(other).data());
  };
  EXPECT_FALSE(differs([](RankHeader&) {}));
  EXPECT_TRUE(differs([](RankHeader& x) { x.hidden = 128; }));
  EXPECT_TRUE(differs([](RankHeader& x) { x.topk = 3; }));
  EXPECT_TRUE(differs([](RankHeader& x) { x.pad_multiple = 2; }));
  EXPECT_TRUE(differs([](RankHeader& x) { x.mode = DispatchMode::budget; }));
  EXPECT_TRUE(differs([](RankHeader& x) { x.multihot = true; }));
  EXPECT_TRUE(differs([](RankHeader& x) { x.fp8 = true; }));
  EXPECT_FALSE(differs([](RankHeader& x) { x.budget_rows = 5; }));  // compared in budget mode only
  EXPECT_TRUE(header_failed(encode(h).data()));
}

TEST(HybridEpLayout, AbortReasons) {
  const int E = 4;
  const std::vector<std::int64_t> counts = {3, 1, 0, 2, 1, 1, 1, 1};  // R = 2
  // A peer failed its host checks: named argument, on every other rank; nothing on the failing one.
  {
    std::vector<RankHeader> h = {header(E, 5), header(E, 5)};
    h[1].failed = true;
    h[1].argument = "weights";
    const Snapshot s = snapshot_of(h, counts, E);
    const std::string w = what_of(abort_reason(s, 0, 1000));
    EXPECT_NE(w.find("'weights'"), std::string::npos) << w;
    EXPECT_NE(w.find("rank 1 failed its checks"), std::string::npos) << w;
    EXPECT_EQ(abort_reason(s, 1, 1000), nullptr);
  }
  // A bad expert id found on the device of rank 0.
  {
    std::vector<RankHeader> h = {header(E, 5), header(E, 5)};
    h[0].device_arg = 1;
    h[0].device_row = 2;
    h[0].device_column = 1;
    h[0].device_value = 9;
    h[0].device_limit = E;
    const Snapshot s = snapshot_of(h, counts, E);
    const std::string mine = what_of(abort_reason(s, 0, 1000)), other = what_of(abort_reason(s, 1, 1000));
    EXPECT_NE(mine.find("value 9 at [2, 1] is out of range"), std::string::npos) << mine;
    EXPECT_NE(other.find("rank 0 failed its checks"), std::string::npos) << other;
    EXPECT_NE(other.find("'indices'"), std::string::npos) << other;
  }
  // Configuration mismatch.
  {
    std::vector<RankHeader> h = {header(E, 5), header(E, 5)};
    h[1].hidden = 32;
    const std::string w = what_of(abort_reason(snapshot_of(h, counts, E), 0, 1000));
    EXPECT_NE(w.find("rank 1 has H=32 but rank 0 has H=64"), std::string::npos) << w;
  }
  // FP8 rows on one rank, bf16 on the others.
  {
    std::vector<RankHeader> h = {header(E, 5), header(E, 5)};
    h[1].fp8 = true;
    const std::string w = what_of(abort_reason(snapshot_of(h, counts, E), 0, 1000));
    EXPECT_NE(w.find("rank 1 has FP8 (dispatch_fp8) rows but rank 0 has bf16 (dispatch) rows"), std::string::npos) << w;
  }
  // Budget overflow under the error policy: DispatchPlan::build's message naming the rank.
  {
    std::vector<RankHeader> h = {header(E, 5), header(E, 5)};
    for (auto& x : h) x.mode = DispatchMode::budget, x.budget_rows = 3;
    const std::string w = what_of(abort_reason(snapshot_of(h, counts, E), 1, 1000));
    EXPECT_NE(w.find("overflow: rank 0 needs 6"), std::string::npos) << w;
  }
  // Receive capacity in blocking mode.
  {
    const std::string w = what_of(abort_reason(snapshot_of({header(E, 5), header(E, 5)}, counts, E), 0, 4));
    EXPECT_NE(w.find("rank 0 needs 6 expert-major rows"), std::string::npos) << w;
    EXPECT_NE(w.find("max_recv_rows"), std::string::npos) << w;
  }
}

TEST(HybridEpLayout, PhaseNamesAndStatusErrors) {
  EXPECT_EQ(phase_name(Phase::dispatch_counts), "dispatch:count-exchange");
  EXPECT_EQ(phase_name(Phase::combine_partials), "combine:partials");
  Status st{};
  st.code = static_cast<int>(StatusCode::timeout);
  st.phase = static_cast<int>(Phase::combine_partials);
  st.peer = 1;
  try {
    std::rethrow_exception(status_error(st, 0, 3.0));
  } catch (const TimeoutError& e) {
    EXPECT_EQ(e.phase(), "combine:partials");
    EXPECT_EQ(e.peer(), 1);
  }
}

// ---- buffer configuration and geometry --------------------------------------------------------------------

TEST(HybridEpLayout, BufferConfigAndGeometry) {
  const BufferConfig c = make_buffer_config(2, 64, 4096, 7168, 8, 0, 128);
  EXPECT_EQ(c.slots, 8);
  EXPECT_EQ(c.width(), 8);
  EXPECT_EQ(c.capacity_rows, 2 * 4096 * 8 + 32 * 127);
  EXPECT_EQ(make_buffer_config(2, 64, 4096, 7168, 0, 0, 1).slots, 64);  // 0 = E: any k, multihot
  EXPECT_EQ(make_buffer_config(2, 64, 4096, 7168, 0, 0, 1).width(), 32);
  EXPECT_EQ(make_buffer_config(2, 64, 4096, 7168, 8, 1000, 1).capacity_rows, 1000);
  EXPECT_THROW(make_buffer_config(2, 63, 16, 64, 0, 0, 1), ArgumentError);   // E not divisible
  EXPECT_THROW(make_buffer_config(2, 64, 16, 60, 0, 0, 1), ArgumentError);   // H % 8
  EXPECT_NO_THROW(make_buffer_config(2, 64, 16, kMaxHidden, 0, 0, 1));
  try {  // rows the kernels' ring stages cannot hold are refused by name, with the limit
    make_buffer_config(2, 64, 16, kMaxHidden + 8, 0, 0, 1);
    ADD_FAILURE() << "H above kMaxHidden was accepted";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "hidden");
    EXPECT_NE(std::string(e.what()).find("[8, 8192]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("got 8200"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_buffer_config(40, 80, 16, 64, 0, 0, 1), ArgumentError);  // too many ranks
  EXPECT_THROW(make_buffer_config(2, 64, 0, 64, 0, 0, 1), ArgumentError);    // no tokens
  EXPECT_EQ(make_buffer_config(8, kMaxExperts, 16, 64, 8, 0, 1).experts, kMaxExperts);
  try {  // more experts than the preprocess kernel's shared memory holds (8 ranks of 1024)
    make_buffer_config(8, 8192, 16, 64, 8, 0, 1);
    ADD_FAILURE() << "8192 experts were accepted";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "num_experts");
    EXPECT_NE(std::string(e.what()).find("at most 4096 experts in all"), std::string::npos) << e.what();
  }

  const DispatchGeometry g = dispatch_geometry(c);
  EXPECT_EQ(g.window_bytes % 4096, 0u);
  EXPECT_LE(g.off_counts + 2 * g.slot_bytes, g.off_records);
  // A slot as written: the header's values in two words each, then a word per expert (LL words); the
  // abort snapshot keeps the values in the same stride.
  EXPECT_GE(g.slot_bytes, static_cast<std::size_t>(2 * word::count + c.experts) * 8);
  EXPECT_GE(g.slot_bytes, g.slot_words * 8);
  EXPECT_LE(g.off_records + 2 * 4096 * static_cast<std::size_t>(g.record_bytes), g.off_probs);
  EXPECT_LE(g.off_probs + static_cast<std::size_t>(c.capacity_rows) * 4, g.off_tokens);
  EXPECT_LE(g.off_tokens + static_cast<std::size_t>(c.capacity_rows) * 7168 * 2, g.window_bytes);
  EXPECT_EQ(g.off_tokens % 256, 0u);
  EXPECT_EQ(g.off_tpe, g.off_control + sizeof(DispatchControl));  // one copy reads both
  EXPECT_GE(g.local_bytes, g.off_plan_done + 4);
  EXPECT_GE(g.off_plan_chunk_base, g.off_plan_slot_rows + 4096 * 8 * 4);  // T * slots int32 ranks
  // Chunk flags only (the counts carry their own epochs: no count flags).
  EXPECT_EQ(g.flag_bytes, (2 * static_cast<std::size_t>(g.max_chunks) * 4 + 127) / 128 * 128);
  EXPECT_EQ(g.off_scales, g.off_tokens + static_cast<std::size_t>(c.capacity_rows) * 7168 * 2);  // none: bf16 only
  const BufferConfig c8 = make_buffer_config(2, 64, 4096, 7168, 8, 0, 128, true);
  const DispatchGeometry g8 = dispatch_geometry(c8);
  EXPECT_LE(g8.off_scales + static_cast<std::size_t>(c8.capacity_rows) * (7168 / 128) * 4, g8.window_bytes);
  EXPECT_EQ(g8.off_scales % 256, 0u);
  EXPECT_GT(g8.window_bytes, g.window_bytes);
  EXPECT_THROW(make_buffer_config(2, 64, 16, 2048 + 128, 0, 0, 1, true), ArgumentError);  // FP8: H % 512
  const CombineGeometry cg = combine_geometry(c);
  EXPECT_GE(cg.off_grads, 2ull * 4096 * 7168 * 2);
  EXPECT_EQ(cg.window_bytes % 4096, 0u);
  EXPECT_EQ(cg.flag_consumed, 2u * static_cast<std::size_t>(cg.max_chunks));
}

}  // namespace
}  // namespace flexep::hybridep
