// The wgrad kernel's epilogue addressing (src/cuda/sm90_epilogue.h) against the two things it must
// agree with: the wgmma accumulator layout (PTX ISA, "wgmma D fragment": value e + 2 h + 4 j of
// thread t is row 16 (t / 32) + (t % 32) / 4 + 8 h, column 8 j + 2 (t % 4) + e) and the TMA unit's
// reading of a 128-byte-swizzled box (chunk c of row r is stored at chunk c ^ (r % 8)).
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <utility>

#include "cuda/sm90_epilogue.h"

namespace flexep::testing {
namespace {

struct Element {
  int row, col;  // in the warpgroup's 64 x 256 piece
};

// What the TMA unit stores from byte `offset` of round `round`'s buffer.
template <int kSize>
Element read_back(int round, int offset) {
  using B = cuda::sm90::EpilogueBoxes<kSize>;
  const int box = offset / B::kBytes, in_box = offset % B::kBytes, r = in_box / B::kRowBytes;
  const int swizzled = in_box % B::kRowBytes, plain = ((swizzled / 16) ^ (r % 8)) * 16 + swizzled % 16;
  return {round * B::kRows + r, box * B::kCols + plain / kSize};
}

template <int kSize>
void every_pair_lands_where_the_tma_unit_reads_it() {
  using B = cuda::sm90::EpilogueBoxes<kSize>;
  std::set<std::pair<int, int>> stored;  // (row, col) of every element, over all rounds
  for (int round = 0; round < B::kRounds; ++round) {
    std::map<int, int> owner;  // byte -> thread, to find overlapping writes
    for (int t = 0; t < 128; ++t) {
      const int warp = t / 32, lane = t % 32;
      if (B::round_of(warp) != round) continue;
      for (int j = 0; j < 32; ++j) {
        for (int h = 0; h < 2; ++h) {
          const int at = B::thread_base(warp, lane) + B::pair_offset(j, h, B::swizzle(lane));
          SCOPED_TRACE("size " + std::to_string(kSize) + ", thread " + std::to_string(t) + ", j " + std::to_string(j) +
                       ", h " + std::to_string(h));
          ASSERT_GE(at, 0);
          ASSERT_LE(at + 2 * kSize, B::kBufferBytes);
          ASSERT_EQ(at % (2 * kSize), 0) << "a pair is one aligned write";
          for (int b = 0; b < 2 * kSize; ++b) ASSERT_TRUE(owner.emplace(at + b, t).second) << "byte " << at + b;
          const int row = 16 * warp + lane / 4 + 8 * h, col = 8 * j + 2 * (lane % 4);
          for (int e = 0; e < 2; ++e) {
            const Element got = read_back<kSize>(round, at + e * kSize);
            EXPECT_EQ(got.row, row);
            EXPECT_EQ(got.col, col + e);
            stored.emplace(got.row, got.col);
          }
        }
      }
    }
    EXPECT_EQ(static_cast<int>(owner.size()), B::kBufferBytes) << "round " << round << " fills its buffer";
  }
  EXPECT_EQ(stored.size(), 64u * 256u) << "every element of the piece, once";
}

TEST(Sm90Epilogue, F32PairsLandWhereTheTmaUnitReadsThem) { every_pair_lands_where_the_tma_unit_reads_it<4>(); }

TEST(Sm90Epilogue, Bf16PairsLandWhereTheTmaUnitReadsThem) { every_pair_lands_where_the_tma_unit_reads_it<2>(); }

// A warp's writes of one (h, j) take the fewest shared-memory wavefronts: each 128-byte wavefront's
// 32 banks are hit equally often.
template <int kSize>
void a_warps_writes_cover_the_banks_evenly() {
  using B = cuda::sm90::EpilogueBoxes<kSize>;
  for (int warp = 0; warp < 4; ++warp)
    for (int j = 0; j < 32; ++j)
      for (int h = 0; h < 2; ++h) {
        std::map<int, int> words_per_bank;
        for (int lane = 0; lane < 32; ++lane) {
          const int at = B::thread_base(warp, lane) + B::pair_offset(j, h, B::swizzle(lane));
          for (int w = 0; w < 2 * kSize / 4; ++w) ++words_per_bank[(at / 4 + w) % 32];
        }
        ASSERT_EQ(words_per_bank.size(), 32u) << "warp " << warp << ", j " << j << ", h " << h;
        for (const auto& [bank, n] : words_per_bank) EXPECT_EQ(n, 2 * kSize / 4) << "bank " << bank;
      }
}

TEST(Sm90Epilogue, F32WritesCoverTheBanksEvenly) { a_warps_writes_cover_the_banks_evenly<4>(); }

TEST(Sm90Epilogue, Bf16WritesCoverTheBanksEvenly) { a_warps_writes_cover_the_banks_evenly<2>(); }

}  // namespace
}  // namespace flexep::testing
