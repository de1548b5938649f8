// Word positions of the call signature (call_signature.h) that the GPU backends exchange before a
// dispatch moves data: int64 words, the same positions in the alltoall and hybridep backends, each
// of which names them word::... and may append words of its own after kWords.
//
// Plain constants and no includes: the CUDA kernels read and write these words too
// (alltoall/route.cu; hybridep/preprocess.cu through layout_math.h).
#pragma once

namespace flexep::call_signature {

namespace word {
constexpr int status = 0;    // 1: this rank's host-side checks failed
constexpr int argument = 1;  // 4 words: the failing argument's name, 8 chars each (truncated)
constexpr int argument_words = 4;
constexpr int device_arg = 5;  // cuda::DeviceArg of a device-side violation (0 = none), then its DeviceErrorRecord:
constexpr int device_row = 6;  //   row, column, value, limit
constexpr int device_column = 7;
constexpr int device_value = 8;
constexpr int device_limit = 9;
constexpr int experts = 10;
constexpr int multihot = 11;
constexpr int hidden = 12;
constexpr int topk = 13;  // k in the top-k form (0 in the multihot form); compared only there
constexpr int mode = 14;  // 0 blocking, 1 budget
constexpr int pad_multiple = 15;
constexpr int budget_rows = 16;
constexpr int overflow = 17;  // 0 error, 1 drop
constexpr int tokens = 18;    // T of this rank's call (may differ per rank)
}  // namespace word

// Words of the shared signature; a backend's own words follow.
constexpr int kWords = 19;

}  // namespace flexep::call_signature
