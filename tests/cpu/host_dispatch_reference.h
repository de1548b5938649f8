// Independent reference of docs/semantics.md for the dispatcher tests: random per-rank inputs, and the
// expected dispatch/combine written with plain loops and a sort, sharing no code with
// core/plan.cpp or the host backend.
#pragma once

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "cpu/host_ranks.h"
#include "flexep/dispatch/host.h"

namespace flexep::testing {

struct RankInput {
  Tensor hidden;              // [T, H]
  Tensor indices;             // [T, k]
  Tensor weights;             // [T, k]
  Tensor routing_map, probs;  // multihot form of the same routing (filled by make_inputs)
  DispatchInput topk() const {
    DispatchInput in;
    in.hidden = hidden;
    in.indices = indices;
    in.weights = weights;
    return in;
  }
  DispatchInput multihot() const {
    DispatchInput in;
    in.hidden = hidden;
    in.routing_map = routing_map;
    in.probs = probs;
    return in;
  }
};

struct Spec {
  int ranks = 2;
  int experts = 4;
  std::int64_t hidden = 8;
  int topk = 2;
  std::vector<std::int64_t> tokens;  // per rank; default: ragged with zeros
  DType hidden_dtype = DType::f32;
  DType weight_dtype = DType::f32;
  DType index_dtype = DType::i64;
  double p_none = 0.25;  // probability that a slot is -1
  bool dyadic = false;   // hidden values k/4 with |k| <= 16: sums of a few are exact
  int only_expert = -1;  // >= 0: every token's first slot goes there, the others are -1
  std::uint32_t seed = 1;
};

inline std::vector<std::int64_t> ragged_tokens(int R) {
  static const std::int64_t pattern[] = {5, 0, 12, 3, 0, 9, 1, 7};
  std::vector<std::int64_t> t;
  for (int r = 0; r < R; ++r) t.push_back(R == 1 ? 6 : pattern[r % 8]);
  return t;
}

inline std::int64_t index_value(const TensorView& idx, std::int64_t i) {
  return idx.dtype == DType::i32 ? idx.ptr<std::int32_t>()[i] : idx.ptr<std::int64_t>()[i];
}

inline std::vector<RankInput> make_inputs(const Spec& s) {
  const std::vector<std::int64_t> T = s.tokens.empty() ? ragged_tokens(s.ranks) : s.tokens;
  std::vector<RankInput> out;
  for (int r = 0; r < s.ranks; ++r) {
    std::mt19937 rng(s.seed * 7919u + static_cast<unsigned>(r));
    const std::int64_t t_r = T[static_cast<std::size_t>(r)];
    RankInput in;
    Tensor h = Tensor::empty({t_r, s.hidden}, DType::f64);
    std::normal_distribution<double> normal;
    std::uniform_int_distribution<int> small(-16, 16);
    for (std::int64_t i = 0; i < h.numel(); ++i) h.data<double>()[i] = s.dyadic ? small(rng) / 4.0 : normal(rng);
    in.hidden = h.to(s.hidden_dtype);
    Tensor idx = Tensor::empty({t_r, s.topk}, DType::i64);
    Tensor w = Tensor::empty({t_r, s.topk}, DType::f64);
    std::vector<int> experts(static_cast<std::size_t>(s.experts));
    std::uniform_real_distribution<double> u01(0.0, 1.0);
    for (std::int64_t t = 0; t < t_r; ++t) {
      for (int e = 0; e < s.experts; ++e) experts[static_cast<std::size_t>(e)] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int j = 0; j < s.topk; ++j) {
        std::int64_t e = experts[static_cast<std::size_t>(j)];
        if (s.only_expert >= 0)
          e = j == 0 ? s.only_expert : -1;
        else if (u01(rng) < s.p_none)
          e = -1;
        idx.data<std::int64_t>()[t * s.topk + j] = e;
        w.data<double>()[t * s.topk + j] = 0.05 + 0.95 * u01(rng);
      }
    }
    in.indices = idx.to(s.index_dtype);
    in.weights = w.to(s.weight_dtype);
    in.routing_map = Tensor::zeros({t_r, s.experts}, DType::b8);
    in.probs = Tensor::zeros({t_r, s.experts}, s.weight_dtype);
    for (std::int64_t t = 0; t < t_r; ++t)
      for (int j = 0; j < s.topk; ++j) {
        const std::int64_t e = idx.data<std::int64_t>()[t * s.topk + j];
        if (e < 0) continue;
        in.routing_map.data<bool>()[t * s.experts + e] = true;
        write_from_double(in.probs, t * s.experts + e, read_as_double(in.weights, t * s.topk + j));
      }
    out.push_back(std::move(in));
  }
  return out;
}

struct Slot {
  int owner = -1;
  std::int64_t row = -1;  // -1: no expert or dropped
};

struct Reference {
  std::vector<Tensor> tokens, probs;                 // per receiver
  std::vector<std::vector<std::int64_t>> tpe;        // per receiver
  std::vector<std::int64_t> dropped, required_rows;  // per receiver
  std::vector<std::vector<Slot>> dest;               // per source, [T * k]
};

inline std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

inline Reference reference_dispatch(const std::vector<RankInput>& in, int E, const DispatchOptions& opt) {
  const int R = static_cast<int>(in.size()), L = E / R;
  const bool budget = opt.mode == DispatchMode::budget;
  using Pair = std::tuple<std::int64_t, int, std::int64_t, std::int64_t>;  // expert, source, token, slot
  std::vector<Pair> pairs;
  Reference ref;
  for (int s = 0; s < R; ++s) {
    const TensorView idx = in[static_cast<std::size_t>(s)].indices;
    ref.dest.emplace_back(static_cast<std::size_t>(idx.numel()));
    for (std::int64_t t = 0; t < idx.size(0); ++t)
      for (std::int64_t j = 0; j < idx.size(1); ++j) {
        const std::int64_t e = index_value(idx, t * idx.size(1) + j);
        if (e >= 0) pairs.emplace_back(e, s, t, j);
      }
  }
  std::sort(pairs.begin(), pairs.end());
  const std::int64_t H = in[0].hidden.size(1);
  const DType hd = in[0].hidden.dtype(), wd = in[0].weights.dtype();
  for (int r = 0; r < R; ++r) {
    std::vector<std::int64_t> tpe(static_cast<std::size_t>(L));
    std::int64_t cursor = 0, dropped = 0;
    std::vector<std::tuple<std::int64_t, int, std::int64_t, std::int64_t>> placed;  // row, src, t, j
    for (int le = 0; le < L; ++le) {
      const std::int64_t begin = cursor;
      std::int64_t n = 0;
      for (const auto& [e, s, t, j] : pairs) {
        if (e != r * L + le) continue;
        const std::int64_t row = begin + n++;
        if (budget && row >= opt.budget_rows) {
          ++dropped;
          continue;
        }
        const std::int64_t k = in[static_cast<std::size_t>(s)].indices.size(1);
        ref.dest[static_cast<std::size_t>(s)][static_cast<std::size_t>(t * k + j)] = {r, row};
        placed.emplace_back(row, s, t, j);
      }
      const std::int64_t end = begin + round_up(n, opt.pad_multiple);
      tpe[static_cast<std::size_t>(le)] =
          budget ? std::max<std::int64_t>(0, std::min(end, opt.budget_rows) - begin) : end - begin;
      cursor = end;
    }
    const std::int64_t N = budget ? opt.budget_rows : cursor;
    Tensor tok = Tensor::zeros({N, H}, hd), pr = Tensor::zeros({N}, wd);
    const std::size_t rb = static_cast<std::size_t>(H) * element_size(hd), pb = element_size(wd);
    for (const auto& [row, s, t, j] : placed) {
      const RankInput& src = in[static_cast<std::size_t>(s)];
      std::memcpy(static_cast<char*>(tok.raw()) + row * rb, static_cast<const char*>(src.hidden.raw()) + t * rb, rb);
      std::memcpy(static_cast<char*>(pr.raw()) + row * pb,
                  static_cast<const char*>(src.weights.raw()) + (t * src.weights.size(1) + j) * pb, pb);
    }
    ref.tokens.push_back(tok);
    ref.probs.push_back(pr);
    ref.tpe.push_back(tpe);
    ref.dropped.push_back(dropped);
    ref.required_rows.push_back(cursor);
  }
  return ref;
}

// Combine of rows[r] ([N_r, H] per rank) back to source s: ascending expert id, fp32 accumulation
// (fp64 for f64), cast to the rows' dtype at the end.
// `v` after a round trip through dtype `dt` (bf16/f16 rounding; identity for f32).
inline double round_to_dtype(float v, DType dt) {
  Tensor one = Tensor::empty({1}, dt);
  write_from_double(one, 0, v);
  return read_as_double(one, 0);
}

inline Tensor reference_combine(const std::vector<RankInput>& in, const Reference& ref, const std::vector<Tensor>& rows,
                                int s) {
  const RankInput& src = in[static_cast<std::size_t>(s)];
  const std::int64_t T = src.hidden.size(0), H = src.hidden.size(1), k = src.indices.size(1);
  const DType dt = rows[0].dtype();
  Tensor out = Tensor::empty({T, H}, dt);
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<std::pair<std::int64_t, Slot>> order;
    for (std::int64_t j = 0; j < k; ++j) {
      const Slot d = ref.dest[static_cast<std::size_t>(s)][static_cast<std::size_t>(t * k + j)];
      if (d.row >= 0) order.emplace_back(index_value(src.indices, t * k + j), d);
    }
    std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (std::int64_t h = 0; h < H; ++h) {
      if (dt == DType::f64) {
        double total = 0.0, part = 0.0;  // two levels, as below (no rounding in f64)
        int owner = -1;
        for (const auto& [e, d] : order) {
          if (d.owner != owner) {
            total += part;
            part = 0.0;
            owner = d.owner;
          }
          part += rows[static_cast<std::size_t>(d.owner)].data<double>()[d.row * H + h];
        }
        out.data<double>()[t * H + h] = total + part;
      } else {
        // Two-level sum: per owner rank in fp32, rounded to the row dtype (the wire), then over ranks.
        float total = 0.0f, part = 0.0f;
        int owner = -1;
        for (const auto& [e, d] : order) {
          if (d.owner != owner) {
            if (owner >= 0) total += static_cast<float>(round_to_dtype(part, dt));
            owner = d.owner;
            part = 0.0f;
          }
          part += static_cast<float>(read_as_double(rows[static_cast<std::size_t>(d.owner)], d.row * H + h));
        }
        if (owner >= 0) total += static_cast<float>(round_to_dtype(part, dt));
        write_from_double(out, t * H + h, total);
      }
    }
  }
  return out;
}

inline bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0);
}

// R dispatchers over one world, and a way to run one lambda per rank.
struct Group {
  std::shared_ptr<HostWorld> world;
  std::vector<std::unique_ptr<TokenDispatcher>> d;
  Group(int R, int E, double timeout = 10.0) : world(std::make_shared<HostWorld>(R, timeout)) {
    for (int r = 0; r < R; ++r) d.push_back(make_host_dispatcher(world, r, E));
  }
  std::vector<std::exception_ptr> run(const std::function<void(int, TokenDispatcher&)>& fn) {
    return run_ranks(static_cast<int>(d.size()), [&](int r) { fn(r, *d[static_cast<std::size_t>(r)]); });
  }
};

}  // namespace flexep::testing
