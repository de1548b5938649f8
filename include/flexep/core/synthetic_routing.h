// Synthetic routings for tests, benchmarks and `flexep plan`: k distinct experts per token drawn
// deterministically from (seed, rank, token), with weights that sum to 1.
//   uniform: every expert equally likely;
//   zipf:    expert e has popularity 1 / (e + 1)^s (the hot experts sit on the low ranks);
//   hot:     every token picks expert `hot_expert` first, the rest uniformly.
#pragma once

#include <cstdint>
#include <string_view>

#include "flexep/core/routing.h"

namespace flexep {

enum class RoutingKind { uniform, zipf, hot };

struct RoutingSpec {
  RoutingKind kind = RoutingKind::uniform;
  double zipf_s = 1.2;
  int hot_expert = 0;
};

RoutingKind parse_routing(std::string_view s, const std::string& arg = "routing");
std::string_view to_string(RoutingKind k);

// indices [T, k] int64 (distinct per token), weights [T, k] f32 summing to 1 per token. Row i is the
// routing of token first_token + i of the rank: a long routing can be drawn in pieces.
TopK synthetic_topk(std::int64_t tokens, int topk, int experts, const RoutingSpec& spec, std::uint64_t seed,
                    int rank = 0, std::int64_t first_token = 0);

}  // namespace flexep
