// The two ways a multi-rank GPU suite runs (multi_gpu.h): one rank per GPU, or n simulated ranks
// sharing GPU 0. A suite derives its fixture from RankVariantTest and instantiates it with
// Variant{0} (OneRankPerGpu, label multigpu) and Variant{n} (SimulatedRanks), named by variant_name.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "gpu/multi_gpu.h"

namespace flexep::testing {

struct Variant {
  int simulated = 0;  // 0: one rank per GPU; n: n ranks on GPU 0
};

inline std::string variant_name(const ::testing::TestParamInfo<Variant>& info) {
  return info.param.simulated ? std::to_string(info.param.simulated) + "ranks" : "gpus";
}

class RankVariantTest : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override { simulated_ranks() = GetParam().simulated; }
  void TearDown() override { simulated_ranks() = 0; }
};

}  // namespace flexep::testing
