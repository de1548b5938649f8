// Launchers of the alltoall backend's kernels (route.cu, scan.cu, pack.cu, unpack.cu, reduce.cu).
// Conventions: rows are H 16-bit elements (bf16, moved as raw bits); positions are int32 (the
// dispatcher checks the ranges first, layout.h); nothing here synchronises, and every launcher
// returns at once when there is nothing to do. Buffers of internal indices are written by earlier
// kernels of this backend, but every kernel still bounds-checks what it uses as an index.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dispatch/alltoall/dispatcher/layout.h"
#include "flexep/cuda/device_errors.h"

namespace flexep::alltoall {

// One metadata entry of a sent token row: the local expert on the receiving rank (-1: unused
// entry) and the routing prob of that (token, expert) pair. A row's entries are ordered by
// ascending expert, so summing them in entry order is summing in ascending expert id.
struct SlotMeta {
  int expert;
  float prob;
};
static_assert(sizeof(SlotMeta) == 8, "SlotMeta travels as raw bytes");

struct HeaderWords {
  long long w[word::count];
};

// --- route.cu: the sender's routing and header (counts: dispatch/common/count_routes.h) ---------------------------------------
// Multihot -> slots with k = E: slot_expert[t][j] = the j-th routed expert of t in ascending
// order, -1 after the last; slot_weight likewise (0 after the last).
void launch_multihot_to_slots(const unsigned char* routing_map, const float* probs, std::int64_t tokens, int experts,
                              int* slot_expert, float* slot_weight, cudaStream_t stream);
// Writes the header words, then copies the error record over the device_* words (the record is
// final: the count kernel ran before on the same stream).
void launch_write_header(const HeaderWords& words, const cuda::DeviceErrorRecord* errors, long long* out,
                         cudaStream_t stream);

// --- scan.cu ------------------------------------------------------------------------------------
// out[i] = sum of in[0..i) (CUB). Temporary storage comes from the device pool on `stream`.
void exclusive_sum(const int* in, int* out, std::int64_t n, int device, cudaStream_t stream);

// --- pack.cu: sender ------------------------------------------------------------------------------
// send_pos[d * T + t] = row of token t in the send buffer for rank d (dest_scan where dest_flag is
// set, else -1); the metadata of that row gets one entry per expert of t owned by d, at entry m =
// number of t's experts on d smaller than it (unused entries: expert -1, prob 0); slot_entry[t][j]
// = send row * meta_width + m for slot j (-1 for slots without an expert). The send buffer is
// ordered (destination rank, token) because dest_scan scans dest_flag d-major.
void launch_pack_meta(const int* slot_expert, const float* slot_weight, std::int64_t tokens, int slots,
                      int local_experts, int ranks, int meta_width, const int* dest_flag, const int* dest_scan,
                      int* send_pos, int* slot_entry, SlotMeta* send_meta, cudaStream_t stream);
// dst[send_pos[d * T + t]] = src[t] for every (d, t) with a position; rows of H elements.
void launch_pack_rows(const void* src, std::int64_t tokens, std::int64_t hidden, int ranks, const int* send_pos,
                      void* dst, cudaStream_t stream);

// --- unpack.cu: receiver -------------------------------------------------------------------------
// flags[e * N + i] = 1 when received row i has an entry for local expert e (flags zero on entry).
void launch_mark_received(const SlotMeta* meta, std::int64_t rows, int meta_width, int local_experts, int* flags,
                          cudaStream_t stream);
// out_row[i * M + m] = the expert-major output row of entry m of received row i, or -1 (unused
// entry, or dropped by the budget). params = [expert_begin | kept_rows | pairs_before], L each.
void launch_place_received(const SlotMeta* meta, const int* flag_scan, std::int64_t rows, int meta_width,
                           int local_experts, const long long* params, std::int64_t out_rows, int* out_row,
                           cudaStream_t stream);
// out[out_row[i * M + m]] = rows[i] (and out_probs[...] = meta[i * M + m].prob when out_probs is
// given) for every placed entry. Output rows nobody writes keep their contents (zero them first).
void launch_scatter_rows(const void* rows, const SlotMeta* meta, const int* out_row, std::int64_t count, int meta_width,
                         std::int64_t hidden, void* out, float* out_probs, cudaStream_t stream);

// --- reduce.cu: the two levels of the combine ------------------------------------------------------
// Receiver: partial[i] = bf16(fp32 sum over the placed entries of row i, in entry order, of
// expert_rows[out_row]); a row with no placed entry gets -0.0 (see reduce.cu). When ret_probs is
// given, ret_probs[i * M + m] = grad_probs[out_row] for placed entries, else 0.
void launch_partial_sums(const void* expert_rows, const int* out_row, std::int64_t count, int meta_width,
                         std::int64_t hidden, void* partial, const float* grad_probs, float* ret_probs,
                         cudaStream_t stream);
// Source: out[t] = bf16(fp32 sum over ranks d ascending of partials[send_pos[d * T + t]]).
void launch_sum_partials(const void* partials, const int* send_pos, std::int64_t tokens, int ranks,
                         std::int64_t hidden, void* out, cudaStream_t stream);
// Source: top-k: out[t][j] = ret_probs[slot_entry[t][j]] (0 without an entry); multihot (slots =
// E): out[t][slot_expert[t][j]] = the same, out zero on entry.
void launch_gather_weight_grads(const float* ret_probs, const int* slot_entry, const int* slot_expert,
                                std::int64_t tokens, int slots, bool multihot, float* out, cudaStream_t stream);

}  // namespace flexep::alltoall
