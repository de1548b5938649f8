// Launchers of deepep's low-latency kernels (low_latency.cu) and the views they take by value: one
// kernel per direction, no host sync (docs/deepep.md, "Low-latency mode").
#pragma once

#include "dispatch/deepep/kernels/kernels.h"

namespace flexep::deepep {

// A token's slots are a warp's lanes in the combine's weighted sum.
constexpr int kMaxLowLatencyTopk = 32;

// The dispatch: every (token, expert) pair's row (+ FP8 scales) goes to the expert's rank, into
// ll_x at (local expert, this rank, its place among this rank's tokens of that expert), with t * K
// + j in ll_info, then each (expert, this rank) count; one flag per peer (kind kLowLatencyDispatch).
// Then, in the same kernel, every source's flag awaited (deadline) and each local expert's rows
// packed into recv_x in (source, token) order, with recv_count, recv_src_info, layout_range and
// `route` (the way back). A bad id (outside [-1, E), or repeated in a token) is reported and
// sends nothing.
struct LowLatencyDispatchCall {
  SymmetricPeerTable peers{};
  int rank = 0, ranks = 0, experts = 0, local_experts = 0, k = 0, slots = 0;  // slots: K
  std::int64_t tokens = 0, max_tokens = 0;  // T, T_ll
  long long row_bytes = 0;
  int scale_cols = 0;                       // H / 128 with FP8 rows, else 0
  const void* x = nullptr;                  // [T, row_bytes]
  const float* scales = nullptr;            // [T, scale_cols] or null
  const void* indices = nullptr;            // [T, k] int32 or int64
  bool indices_i64 = true;
  cuda::DeviceErrorRecord* errors = nullptr;
  WindowLayout win{};
  OpControl* op = nullptr;
  Status* status = nullptr;
  unsigned long long timeout_ns = 0;
  // This rank's outputs (device memory of the dispatcher):
  void* recv_x = nullptr;            // [L, R * T_ll, row_bytes]
  float* recv_scales = nullptr;      // [L, R * T_ll, scale_cols] or null
  int* recv_count = nullptr;         // [L]
  int* recv_src_info = nullptr;      // [L, R * T_ll]
  long long* layout_range = nullptr; // [L, R]
  int* route = nullptr;              // [L, R * T_ll]: (s * T_ll + t) * K + j
};
void launch_low_latency_dispatch(const LowLatencyDispatchCall& c, int ctas, cudaStream_t stream);

// The combine: each local expert's row i of expert_out goes back to its source's ll_back at (t,
// j) (route), one flag per source (kind kLowLatencyCombine); then, in the same kernel, every
// rank's flag awaited and out[t] = the fp32 sum over t's sending slots j ascending of w[t][j] *
// row (t, j), products and sums rounded once each, rounded to bf16 (core/low_latency.h).
struct LowLatencyCombineCall {
  SymmetricPeerTable peers{};
  int rank = 0, ranks = 0, experts = 0, local_experts = 0, k = 0, slots = 0;
  std::int64_t tokens = 0, max_tokens = 0, hidden = 0;
  const void* expert_out = nullptr;  // [L, R * T_ll, H] bf16
  const int* recv_count = nullptr;   // [L]
  const int* route = nullptr;        // [L, R * T_ll]
  const void* indices = nullptr;     // [T, k] of the dispatch's source side
  bool indices_i64 = true;
  const float* weights = nullptr;    // [T, k]
  WindowLayout win{};
  OpControl* op = nullptr;
  Status* status = nullptr;
  unsigned long long timeout_ns = 0;
  void* out = nullptr;               // [T, H] bf16
};
void launch_low_latency_combine(const LowLatencyCombineCall& c, int ctas, cudaStream_t stream);

}  // namespace flexep::deepep
