// How the hybridep kernels split their work into parts (src/dispatch/hybridep/kernels/parts.h): every
// token of every rank lies in exactly one part, parts never cross a chunk (a chunk's flag is
// released when its parts are counted), every chunk has exactly per_chunk parts (the count that
// releases its flag), and the split gives each pipeline enough parts. The kernels run this same
// code; here it runs on the CPU over many token counts, rank sets and grid sizes.
#include <gtest/gtest.h>

#include <tuple>
#include <vector>

// Internal header of the backend (pure C++, no CUDA); the tests' include path has no src/.
#include "dispatch/hybridep/kernels/parts.h"

namespace flexep::hybridep {
namespace {

TEST(HybridEpParts, SplitIsAPowerOfTwoDividingTheChunkAndGivesEveryPipelineEightParts) {
  for (long long chunks : {1LL, 2LL, 4LL, 8LL, 33LL, 128LL, 1000LL}) {
    for (int pipelines : {1, 2, 8, 16, 32, 48, 64, 96, 256, 264}) {
      SCOPED_TRACE("chunks " + std::to_string(chunks) + ", pipelines " + std::to_string(pipelines));
      const PartSplit s = part_split(chunks, pipelines);
      EXPECT_EQ(s.tokens * s.per_chunk, kChunkTokens);
      EXPECT_EQ(s.tokens & (s.tokens - 1), 0) << s.tokens;
      const long long parts = chunks * s.per_chunk;
      if (s.tokens >= kMinAutoPartTokens) {
        // Either 8 parts per pipeline, or parts already at the smallest size balance asks for...
        EXPECT_TRUE(parts >= 8LL * pipelines || s.tokens == kMinAutoPartTokens) << s.tokens;
        // ...and the largest such size: twice as large would give fewer than 8 parts per pipeline.
        if (s.tokens < kChunkTokens) {
          EXPECT_LT(chunks * (s.per_chunk / 2), 8LL * pipelines);
        }
        // Smaller than that only where half the size would still give no pipeline two parts.
        if (s.tokens == kMinAutoPartTokens) {
          EXPECT_GT(2 * parts, pipelines);
        }
      } else {
        // Split below that only while every pipeline still gets at most one part; never below
        // kMinSpreadPartTokens.
        EXPECT_GE(s.tokens, kMinSpreadPartTokens);
        EXPECT_LE(parts, pipelines);
      }
    }
  }
  // The two shapes of the benchmark cases at 16 SMs x 2 pipelines.
  EXPECT_EQ(part_split(num_chunks(4096), 32).tokens, 16);  // 128 chunks: 256 parts
  EXPECT_EQ(part_split(num_chunks(128), 32).tokens, 4);    // decode, 4 chunks: a part per pipeline
  // Decode at 32 SMs: 2-token parts, so that 64 pipelines get one each; at 64 SMs 1-token parts.
  EXPECT_EQ(part_split(num_chunks(128), 64).tokens, 2);
  EXPECT_EQ(part_split(num_chunks(128), 128).tokens, 1);
  // Decode at 24 SMs (48 pipelines): 32 parts of 4 tokens, not 64 of 2 (16 pipelines with two).
  EXPECT_EQ(part_split(num_chunks(128), 48).tokens, 4);
}

// The fused small-call kernel needs a send part for every pipeline (parts.h says why).
TEST(HybridEpParts, EveryPipelineSendsWhenThereAreAtLeastAsManyPartsAsPipelines) {
  // Decode (128 tokens, 4 chunks) at 2 pipelines per CTA: 8, 16, 32, 64 SMs yes; 24, 48 SMs no.
  EXPECT_TRUE(every_pipeline_sends(128, 16));
  EXPECT_TRUE(every_pipeline_sends(128, 32));   // 32 parts of 4
  EXPECT_TRUE(every_pipeline_sends(128, 64));   // 64 parts of 2
  EXPECT_TRUE(every_pipeline_sends(128, 128));  // 128 parts of 1
  EXPECT_FALSE(every_pipeline_sends(128, 48));  // 32 parts of 4
  EXPECT_FALSE(every_pipeline_sends(128, 96));  // 64 parts of 2 (1-token parts would give some two)
  EXPECT_FALSE(every_pipeline_sends(128, 160)); // 128 parts of 1 (the floor)
  EXPECT_FALSE(every_pipeline_sends(0, 40));    // one empty chunk: 32 parts of 1
  EXPECT_FALSE(every_pipeline_sends(128, 64, 32));  // forced whole chunks: 4 parts
  for (long long T : {0LL, 1LL, 33LL, 128LL, 200LL, 256LL})
    for (int pipelines : {1, 8, 40, 48, 64, 128}) {
      const long long chunks = num_chunks(T);
      EXPECT_EQ(every_pipeline_sends(T, pipelines), chunks * part_split(chunks, pipelines).per_chunk >= pipelines)
          << T << " tokens, " << pipelines << " pipelines";
    }
}

// The fused kernel's grid: the largest within the SMs given (down to half of them) whose every
// pipeline sends a part; a forced part size keeps the grid as given.
TEST(HybridEpParts, FusedGridIsTheLargestWhoseEveryPipelineSends) {
  // Decode (128 tokens) at 2 pipelines per CTA: 8, 16, 32 and 64 SMs as given; 24 -> 16 (32 parts of
  // 4), 48 -> 32 (64 parts of 2), 80 -> 64 (128 parts of 1); 160 SMs would need 80, and 64 is below
  // half: none.
  EXPECT_EQ(fused_grid(128, 8, 2), 8);
  EXPECT_EQ(fused_grid(128, 16, 2), 16);
  EXPECT_EQ(fused_grid(128, 24, 2), 16);
  EXPECT_EQ(fused_grid(128, 32, 2), 32);
  EXPECT_EQ(fused_grid(128, 48, 2), 32);
  EXPECT_EQ(fused_grid(128, 64, 2), 64);
  EXPECT_EQ(fused_grid(128, 80, 2), 64);
  EXPECT_EQ(fused_grid(128, 160, 2), 0);
  EXPECT_EQ(fused_grid(128, 0, 2), 0);
  EXPECT_EQ(fused_grid(128, 64, 2, 32), 0);  // forced whole chunks: 4 parts for 128 pipelines
  EXPECT_EQ(fused_grid(128, 2, 2, 32), 2);   // 4 parts for 4 pipelines
  EXPECT_EQ(fused_grid(128, 24, 2, 4), 0);   // forced 4-token parts: 32 parts for 48 pipelines
  for (long long T : {0LL, 1LL, 33LL, 200LL, 256LL})
    for (int max_grid : {1, 8, 20, 24, 48, 132}) {
      const int g = fused_grid(T, max_grid, 2);
      int want = 0;
      for (int h = max_grid; h > 0 && 2 * h >= max_grid && want == 0; --h)
        if (every_pipeline_sends(T, 2 * h)) want = h;
      EXPECT_EQ(g, want) << T << " tokens, " << max_grid << " CTAs";
      if (g > 0) {
        EXPECT_LE(g, max_grid);
        EXPECT_GE(2 * g, max_grid);
        EXPECT_TRUE(every_pipeline_sends(T, 2 * g));
      }
    }
  EXPECT_EQ(fused_grid(1, 8, 2), 8);  // one token: one chunk of 16 parts
  // The part sizes decode runs on those grids (docs/hybridep.md, data flow 5'): 4 tokens at 8, 16 and
  // 24 SMs (two parts per pipeline at 8), 2 at 32 and 48, 1 at 64. Parts of at most 2 tokens are the
  // ones whose local rows the fused kernel's consumer holds back (kHoldLocalTokens).
  for (const auto& [sms, tokens, per_pipeline] : {std::tuple{8, 4, 2}, {16, 4, 1}, {24, 4, 1}, {32, 2, 1},
                                                   {48, 2, 1}, {64, 1, 1}}) {
    const int pipelines = 2 * fused_grid(128, sms, 2);
    const PartSplit split = part_split(num_chunks(128), pipelines, 0);
    EXPECT_EQ(split.tokens, tokens) << sms << " SMs";
    EXPECT_EQ(num_chunks(128) * split.per_chunk, per_pipeline * pipelines) << sms << " SMs";
  }
}

// HybridEpOptions::part_tokens: a valid size is taken as it is, whatever the grid; 0 and invalid
// sizes leave the choice to the split (the dispatcher rejects invalid ones before a kernel runs).
TEST(HybridEpParts, AForcedSizeIsTakenAndOnlyValidSizesAre) {
  for (int forced : {1, 2, 4, 8, 16, 32}) {
    EXPECT_TRUE(valid_part_tokens(forced));
    for (long long chunks : {1LL, 128LL})
      for (int pipelines : {1, 32, 256}) {
        const PartSplit s = part_split(chunks, pipelines, forced);
        EXPECT_EQ(s.tokens, forced);
        EXPECT_EQ(s.tokens * s.per_chunk, kChunkTokens);
      }
  }
  for (int bad : {0, -4, 3, 6, 12, 64}) {
    EXPECT_FALSE(valid_part_tokens(bad)) << bad;
    EXPECT_EQ(part_split(128, 32, bad).tokens, part_split(128, 32).tokens) << bad;
  }
}

TEST(HybridEpParts, PartsOfOneRankCoverEveryTokenOnceAndStayInsideTheirChunk) {
  for (long long T : {0LL, 1LL, 3LL, 31LL, 32LL, 33LL, 100LL, 128LL, 257LL, 4096LL}) {
    for (int pipelines : {1, 5, 32, 264}) {
      SCOPED_TRACE("T " + std::to_string(T) + ", pipelines " + std::to_string(pipelines));
      const PartSplit s = part_split(num_chunks(T), pipelines);
      const long long parts = static_cast<long long>(num_chunks(T)) * s.per_chunk;
      std::vector<int> hits(static_cast<std::size_t>(T), 0), per_chunk(static_cast<std::size_t>(num_chunks(T)), 0);
      for (long long i = 0; i < parts; ++i) {
        const Part p = part_in_rank(i, s, T, 3);
        EXPECT_EQ(p.source, 3);
        ASSERT_GE(p.chunk, 0);
        ASSERT_LT(p.chunk, num_chunks(T));
        ++per_chunk[static_cast<std::size_t>(p.chunk)];
        EXPECT_GE(p.t0, static_cast<long long>(p.chunk) * kChunkTokens);
        EXPECT_LE(p.t1 - p.t0, s.tokens);
        for (long long t = p.t0; t < p.t1; ++t) {
          ASSERT_LT(t, static_cast<long long>(p.chunk + 1) * kChunkTokens) << "part leaves its chunk";
          ASSERT_LT(t, T) << "part beyond the last token";
          ++hits[static_cast<std::size_t>(t)];
        }
      }
      for (long long t = 0; t < T; ++t) EXPECT_EQ(hits[static_cast<std::size_t>(t)], 1) << "token " << t;
      // Every chunk is counted exactly per_chunk times, the count that releases its flag (also the
      // one chunk of a rank with no token: every (source, receiver) pair exchanges a flag).
      for (int n : per_chunk) EXPECT_EQ(n, s.per_chunk);
    }
  }
}

TEST(HybridEpParts, PartsOfSeveralRanksGoRankByRankAndSkipRanks) {
  const std::vector<long long> tokens = {37, 0, 513, 64, 1};
  const int R = static_cast<int>(tokens.size());
  auto tokens_of = [&](int s) { return tokens[static_cast<std::size_t>(s)]; };
  for (int skipped = -1; skipped < R; ++skipped) {
    auto skip = [skipped](int s) { return s == skipped; };
    long long chunks = 0;
    for (int s = 0; s < R; ++s)
      if (s != skipped) chunks += num_chunks(tokens[static_cast<std::size_t>(s)]);
    EXPECT_EQ(chunks_of_ranks(R, tokens_of, skip), chunks);
    const PartSplit sp = part_split(chunks, 7);
    const long long total = parts_of_ranks(R, sp, tokens_of, skip);
    EXPECT_EQ(total, chunks * sp.per_chunk);
    std::vector<std::vector<int>> hits(static_cast<std::size_t>(R));
    for (int s = 0; s < R; ++s) hits[static_cast<std::size_t>(s)].assign(static_cast<std::size_t>(tokens_of(s)), 0);
    int last_source = -1;
    for (long long i = 0; i < total; ++i) {
      Part p;
      p.source = -1;
      EXPECT_EQ(parts_of_ranks(R, sp, tokens_of, skip, i, &p), total);
      ASSERT_GE(p.source, 0) << "part " << i << " not found";
      EXPECT_NE(p.source, skipped);
      EXPECT_GE(p.source, last_source) << "sources ascend";
      last_source = p.source;
      ASSERT_LE(p.t1, tokens_of(p.source)) << "part beyond the last token";
      for (long long t = p.t0; t < p.t1; ++t) ++hits[static_cast<std::size_t>(p.source)][static_cast<std::size_t>(t)];
    }
    for (int s = 0; s < R; ++s)
      for (int h : hits[static_cast<std::size_t>(s)]) EXPECT_EQ(h, s == skipped ? 0 : 1) << "rank " << s;
  }
}

}  // namespace
}  // namespace flexep::hybridep
