// Where the wgrad kernel's epilogue (wgrad_gemm.cu) puts each accumulator pair in shared memory: the
// 128-byte-swizzled TMA boxes of one round. Shared word for word by the kernel and the CPU test
// (tests/cpu/test_sm90_epilogue.cpp), which reads the boxes back the way the TMA unit does.
//
// A warpgroup's accumulators of a 64 x 256 f32 piece (PTX ISA, "wgmma D fragment", m64nNk16): value
// i = e + 2 h + 4 j of thread t is row 16 (t / 32) + (t % 32) / 4 + 8 h, column 8 j + 2 (t % 4) + e.
// A pair (e = 0, 1) is one 8-byte (f32) or 4-byte (bf16) write. The 128-byte swizzle keeps 16-byte
// chunk c of a box's row r at chunk c ^ (r % 8); a row's r % 8 is (t % 32) / 4, its other terms
// being multiples of 8. A warp's 32 pairs of one (h, j) then cover the banks evenly: its write takes
// the fewest shared-memory wavefronts it can.
//
// No CUDA headers: FLEXEP_SM90_HD marks functions __host__ __device__ only under nvcc.
#pragma once

#if defined(__CUDACC__)
#define FLEXEP_SM90_HD __host__ __device__ inline
#else
#define FLEXEP_SM90_HD inline
#endif

namespace flexep::cuda::sm90 {

// Boxes of elements of kSize bytes, 128-byte rows: bf16 in one round of 64 rows (four boxes of 64
// columns), f32 in two rounds of 32 rows (eight boxes of 32 columns; warps 0-1, then warps 2-3).
template <int kSize>
struct EpilogueBoxes {
  static constexpr int kRowBytes = 128;
  static constexpr int kRounds = kSize == 4 ? 2 : 1;
  static constexpr int kRows = 64 / kRounds;        // a box's rows: one round's
  static constexpr int kCols = kRowBytes / kSize;   // a box's columns
  static constexpr int kBytes = kRows * kRowBytes;  // one box
  static constexpr int kBoxes = 256 / kCols;        // a round's boxes: 32 KB in all
  static constexpr int kBufferBytes = kBoxes * kBytes;

  // The round in which warp `warp` (of its warpgroup) writes its rows.
  FLEXEP_SM90_HD static constexpr int round_of(int warp) { return warp / (4 / kRounds); }
  // A thread's first byte in its round's buffer, and its swizzle term: pair (h, j) lies at
  // thread_base + pair_offset(j, h, swizzle). In the kernel j and h are compile-time, so only the
  // XOR is left per write.
  FLEXEP_SM90_HD static constexpr int thread_base(int warp, int lane) {
    return (16 * warp + lane / 4 - round_of(warp) * kRows) * kRowBytes + pair_byte(lane) % 16;
  }
  FLEXEP_SM90_HD static constexpr int swizzle(int lane) { return (lane / 4) ^ (pair_byte(lane) / 16); }
  FLEXEP_SM90_HD static constexpr int pair_offset(int j, int h, int swizzle) {
    const int chunk = (j * 8 * kSize / 16) % (kRowBytes / 16);  // the 8 columns' first chunk in their row
    return (8 * j / kCols) * kBytes + 8 * h * kRowBytes + (chunk ^ swizzle) * 16;
  }

 private:
  FLEXEP_SM90_HD static constexpr int pair_byte(int lane) { return 2 * (lane % 4) * kSize; }  // in its 8 columns
};

}  // namespace flexep::cuda::sm90
