// Addresses inside the hybridep buffers, in one place: every kernel computes a window, record or
// flag address through these, so the geometry of layout.cpp is encoded exactly once on the device.
#pragma once

#include <cstdint>

#include "dispatch/hybridep/kernels/kernels.h"
#include "dispatch/hybridep/kernels/layout_math.h"

namespace flexep::hybridep {

// ---- dispatch buffer ----------------------------------------------------------------------------------

// Slot of rank `s` in the count region of rank `owner`'s window (LL words: count_words.cuh).
__device__ __forceinline__ unsigned long long* count_slot(const DispatchView& v, int owner, int s) {
  return reinterpret_cast<unsigned long long*>(v.peers.window[owner] + v.off_counts +
                                               static_cast<unsigned long long>(s) * v.slot_bytes);
}

// Record of source `s`'s token `t` in a records region [R][max_tokens].
__device__ __forceinline__ unsigned char* record_at(unsigned char* region, int s, long long t, long long max_tokens,
                                                    int record_bytes) {
  return region + (static_cast<long long>(s) * max_tokens + t) * record_bytes;
}
__device__ __forceinline__ const unsigned char* record_at(const unsigned char* region, int s, long long t,
                                                          long long max_tokens, int record_bytes) {
  return region + (static_cast<long long>(s) * max_tokens + t) * record_bytes;
}

// The records region of rank `owner`'s window.
__device__ __forceinline__ unsigned char* records_of(const DispatchView& v, int owner) {
  return reinterpret_cast<unsigned char*>(v.peers.window[owner] + v.off_records);
}

// The staged record of this rank's token t for destination d (plain memory).
__device__ __forceinline__ unsigned char* staging_at(const DispatchView& v, int d, long long t) {
  return record_at(v.staging, d, t, v.max_tokens, v.record_bytes);
}

// Expert-major output rows, their FP8 scales and probs of rank `owner`. Rows are `row_bytes` long
// (2H for bf16, H for e4m3 packed at the same offset), scales `scale_bytes` (H / 32, FP8 only).
__device__ __forceinline__ uint4* token_row(const DispatchView& v, int owner, long long row, long long row_bytes) {
  return reinterpret_cast<uint4*>(v.peers.window[owner] + v.off_tokens +
                                  static_cast<unsigned long long>(row) * row_bytes);
}
__device__ __forceinline__ uint4* scale_row(const DispatchView& v, int owner, long long row, long long scale_bytes) {
  return reinterpret_cast<uint4*>(v.peers.window[owner] + v.off_scales +
                                  static_cast<unsigned long long>(row) * scale_bytes);
}
__device__ __forceinline__ float* prob_at(const DispatchView& v, int owner, long long row) {
  return reinterpret_cast<float*>(v.peers.window[owner] + v.off_probs) + row;
}

// Flags (uint32) of rank `owner`: chunk flag of (source s, chunk c). (The counts carry their own
// epochs: count_words.cuh.)
__device__ __forceinline__ unsigned* chunk_flag(const DispatchView& v, int owner, int s, int c) {
  return reinterpret_cast<unsigned*>(v.peers.flags[owner]) + static_cast<long long>(s) * v.max_chunks + c;
}

// ---- combine buffer ------------------------------------------------------------------------------------

// Partial row slot (s, t) in rank `owner`'s combine window: the partial that rank s computed for
// token t of `owner` (the source), pushed there by s. The
// combine_backward kernels stage grad_out row t of `owner` at partial_row(v, owner, 0, t).
__device__ __forceinline__ uint4* partial_row(const CombineView& v, int owner, int s, long long t) {
  return reinterpret_cast<uint4*>(v.peers.window[owner] + v.off_partials +
                                  (static_cast<unsigned long long>(s) * v.max_tokens + t) * v.hidden * 2);
}
// Prob gradient of entry i of slot (s, t) in rank `owner`'s combine window (as partial_row).
__device__ __forceinline__ float* grad_at(const CombineView& v, int owner, int s, long long t, int i) {
  return reinterpret_cast<float*>(v.peers.window[owner] + v.off_grads) +
         (static_cast<long long>(s) * v.max_tokens + t) * v.width + i;
}
__device__ __forceinline__ unsigned* ready_flag(const CombineView& v, int owner, int producer, int c) {
  return reinterpret_cast<unsigned*>(v.peers.flags[owner]) + v.flag_ready +
         static_cast<long long>(producer) * v.max_chunks + c;
}
__device__ __forceinline__ unsigned* consumed_flag(const CombineView& v, int owner, int reader) {
  return reinterpret_cast<unsigned*>(v.peers.flags[owner]) + v.flag_consumed + reader;
}
// Rank `producer` failed its checks in the operation of this epoch on the combine buffer, and the
// argument (FailedArg); written on `owner` before the producer releases any flag there.
__device__ __forceinline__ unsigned* abort_flag(const CombineView& v, int owner, int producer) {
  return reinterpret_cast<unsigned*>(v.peers.flags[owner]) + v.flag_abort + producer;
}
__device__ __forceinline__ unsigned* abort_arg_flag(const CombineView& v, int owner, int producer) {
  return reinterpret_cast<unsigned*>(v.peers.flags[owner]) + v.flag_abort_arg + producer;
}

// ---- tokens of a rank in this call --------------------------------------------------------------------

__device__ __forceinline__ long long tokens_of(const DispatchControl* c, int rank, long long max_tokens) {
  return clamp_ll(c->tokens[rank], 0, max_tokens);
}

}  // namespace flexep::hybridep
