// permute: x [T, H] -> expert-major rows along a LocalPlan, as two kernels.
//
// scatter (one warp per source token): the warp reads x[t] once, 16 bytes per lane, and stores each
// vector to all of the token's kept rows. We scatter rather than gather (one warp per destination
// row) because a gather reads x[t] once per slot (k times in all, and x rarely stays in L2 at
// H = 7168), while the scatter reads x once and still writes every kept row exactly once.
//
// fill (one warp per row): the rows no slot lands on, i.e. the padding at the end of each group
// ([begin + kept, begin + tokens_per_expert)) and the tail past the used rows in budget mode, get
// zeros and prob 0. The two kernels write disjoint rows, and together every row of the output once.
#include <algorithm>

#include "flexep/cuda/runtime.h"
#include "cuda/permute_launch.h"

namespace flexep::cuda::permute_detail {

namespace {

constexpr int kWarps = 4;  // warps per block
constexpr int kThreads = kWarps * 32;
constexpr int kMaxPadBlocks = 64;  // blocks per expert for its padding rows (grid-stride beyond)

__global__ void __launch_bounds__(kThreads)
    permute_scatter_kernel(const uint4* __restrict__ x, const float* __restrict__ weights,
                           const std::int32_t* __restrict__ slot_rows, long long tokens, int k, long long vecs_per_row,
                           long long out_rows, uint4* __restrict__ out, float* __restrict__ out_probs) {
  const int lane = threadIdx.x % 32;
  const long long t = static_cast<long long>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (t >= tokens) return;
  const std::int32_t* rows = slot_rows + t * k;
  for (int j = lane; j < k; j += 32) {
    const long long row = rows[j];
    if (row >= 0 && row < out_rows) out_probs[row] = weights[t * k + j];
  }
  const uint4* src = x + t * vecs_per_row;
  for (long long v = lane; v < vecs_per_row; v += 32) {
    const uint4 value = src[v];
    for (int j = 0; j < k; ++j) {
      const long long row = rows[j];  // the check costs nothing and keeps even a corrupt plan in bounds
      if (row >= 0 && row < out_rows) out[row * vecs_per_row + v] = value;
    }
  }
}

// Blocks [0, experts * pad_blocks) zero the padding of expert b / pad_blocks; the tail_blocks after
// them zero the rows [used_rows, out_rows). Row ranges are clamped to the output, so even a corrupt
// plan cannot make this write out of bounds.
__global__ void __launch_bounds__(kThreads)
    fill_unused_rows_kernel(uint4* __restrict__ out, float* __restrict__ out_probs, long long vecs_per_row,
                            long long out_rows, const std::int64_t* __restrict__ expert_begin,
                            const std::int64_t* __restrict__ kept_rows,
                            const std::int64_t* __restrict__ tokens_per_expert,
                            long long experts, int pad_blocks, const std::int64_t* __restrict__ used_rows,
                            int tail_blocks) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const long long b = blockIdx.x;
  long long lo, hi, part, parts;
  if (b < experts * pad_blocks) {
    const long long e = b / pad_blocks;
    part = b - e * pad_blocks;
    parts = pad_blocks;
    lo = expert_begin[e] + kept_rows[e];
    hi = expert_begin[e] + tokens_per_expert[e];
  } else {
    part = b - experts * pad_blocks;
    parts = tail_blocks;
    lo = *used_rows;
    hi = out_rows;
  }
  lo = lo < 0 ? 0 : lo;
  hi = hi > out_rows ? out_rows : hi;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (long long row = lo + part * kWarps + warp; row < hi; row += parts * kWarps) {
    uint4* dst = out + row * vecs_per_row;
    for (long long v = lane; v < vecs_per_row; v += 32) dst[v] = zero;
    if (lane == 0) out_probs[row] = 0.0f;
  }
}

long long ceil_div(long long a, long long b) { return (a + b - 1) / b; }

}  // namespace

void launch_permute(const void* x, const float* weights, const PlanRefs& plan, std::int64_t row_bytes, void* out_tokens,
                    float* out_probs, int sm_count, cudaStream_t stream) {
  const long long vecs = row_bytes / 16;
  auto* out = static_cast<uint4*>(out_tokens);
  if (plan.tokens > 0) {
    permute_scatter_kernel<<<static_cast<unsigned>(ceil_div(plan.tokens, kWarps)), kThreads, 0, stream>>>(
        static_cast<const uint4*>(x), weights, plan.slot_rows, plan.tokens, static_cast<int>(plan.topk), vecs,
        plan.out_rows, out, out_probs);
    FLEXEP_CUDA_CHECK_LAUNCH("permute_scatter");
  }
  // A group has at most pad_multiple - 1 padding rows (a group cut by the budget has none). The tail
  // [used, out_rows) is empty in blocking mode.
  const long long pad_blocks =
      plan.pad_multiple > 1 ? std::min<long long>(ceil_div(plan.pad_multiple - 1, kWarps), kMaxPadBlocks) : 0;
  const long long tail_blocks =
      plan.budget_mode ? std::min<long long>(ceil_div(plan.out_rows, kWarps), 4LL * std::max(sm_count, 1)) : 0;
  const long long grid = plan.experts * pad_blocks + tail_blocks;
  FLEXEP_CHECK(grid < (1LL << 31), "permute: padding grid of ", grid, " blocks is too large");
  if (grid == 0) return;
  fill_unused_rows_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      out, out_probs, vecs, plan.out_rows, plan.expert_begin, plan.kept_rows, plan.tokens_per_expert, plan.experts,
      static_cast<int>(pad_blocks), plan.used_rows, static_cast<int>(tail_blocks));
  FLEXEP_CUDA_CHECK_LAUNCH("fill_unused_rows");
}

}  // namespace flexep::cuda::permute_detail
