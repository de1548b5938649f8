// unpermute (expert rows -> tokens) and gather_slot_values (row values -> [T, k] slots).
//
// unpermute: one warp per token. The warp first ranks the token's kept rows in ascending order
// (into shared memory), then each lane sums 8 columns at a time over those rows in that order,
// in fp32 starting from 0, and rounds once at the end. Ascending row order *is* core unpermute's
// ascending expert order: rows are expert-major, and two rows of one expert in one token (a
// repeated id) follow the slot order, like the (expert, row) sort of core/plan.cpp. Same operands,
// same order, same rounding: the result equals the CPU's bit for bit.
#include <cuda_bf16.h>

#include <cstring>

#include "flexep/cuda/runtime.h"
#include "cuda/permute_launch.h"

namespace flexep::cuda::permute_detail {

namespace {

constexpr int kWarps = 4;  // warps (tokens) per block
constexpr int kThreads = kWarps * 32;
constexpr int kSlotThreads = 256;

__device__ __forceinline__ bool is_row(std::int32_t row, long long out_rows) { return row >= 0 && row < out_rows; }

// acc[i] += p[i] for 8 consecutive elements (p 16-byte aligned).
__device__ __forceinline__ void add8(float (&acc)[8], const __nv_bfloat16* p) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  __nv_bfloat162 h[4];
  memcpy(h, &raw, sizeof(raw));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

__device__ __forceinline__ void add8(float (&acc)[8], const float* p) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  acc[0] += a.x;
  acc[1] += a.y;
  acc[2] += a.z;
  acc[3] += a.w;
  acc[4] += b.x;
  acc[5] += b.y;
  acc[6] += b.z;
  acc[7] += b.w;
}

// p[i] = acc[i] rounded to nearest even.
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&acc)[8]) {
  __nv_bfloat162 h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  uint4 raw;
  memcpy(&raw, h, sizeof(raw));
  *reinterpret_cast<uint4*>(p) = raw;
}

__device__ __forceinline__ void store8(float* p, const float (&acc)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

template <class In, class Out>
__global__ void __launch_bounds__(kThreads)
    unpermute_kernel(const In* __restrict__ rows, const std::int32_t* __restrict__ slot_rows, long long tokens, int k,
                     long long hidden, long long out_rows, Out* __restrict__ out) {
  extern __shared__ std::int32_t order_storage[];  // [kWarps][k]: each warp's token rows, ascending
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const long long t = static_cast<long long>(blockIdx.x) * kWarps + warp;
  if (t >= tokens) return;  // a whole warp leaves; the kernel never synchronises the block
  std::int32_t* order = order_storage + warp * k;
  const std::int32_t* slots = slot_rows + t * k;

  // Rank of each kept row among the token's kept rows (ties, which a sound plan never has, broken by
  // slot so that the ranks are always a permutation of [0, n) and every order[] entry read is written).
  int mine = 0;
  for (int j = lane; j < k; j += 32) {
    const std::int32_t row = slots[j];
    if (!is_row(row, out_rows)) continue;
    ++mine;
    int rank = 0;
    for (int jj = 0; jj < k; ++jj) {
      const std::int32_t other = slots[jj];
      rank += is_row(other, out_rows) && (other < row || (other == row && jj < j));
    }
    order[rank] = row;
  }
  const int n = __reduce_add_sync(0xffffffffu, mine);
  __syncwarp();  // order[] is complete

  for (long long c = 8LL * lane; c < hidden; c += 8LL * 32) {
    float acc[8] = {};
    for (int i = 0; i < n; ++i) add8(acc, rows + static_cast<long long>(order[i]) * hidden + c);
    store8(out + t * hidden + c, acc);
  }
}

__global__ void __launch_bounds__(kSlotThreads)
    gather_slot_values_kernel(const float* __restrict__ values, const std::int32_t* __restrict__ slot_rows,
                              long long slots, long long out_rows, float* __restrict__ out) {
  const long long i = static_cast<long long>(blockIdx.x) * kSlotThreads + threadIdx.x;
  if (i >= slots) return;
  const std::int32_t row = slot_rows[i];
  out[i] = is_row(row, out_rows) ? values[row] : 0.0f;
}

template <class In, class Out>
void unpermute_as(const void* rows, const PlanRefs& plan, std::int64_t hidden, void* out, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((plan.tokens + kWarps - 1) / kWarps);
  const std::size_t smem =
      static_cast<std::size_t>(kWarps) * static_cast<std::size_t>(plan.topk) * sizeof(std::int32_t);
  unpermute_kernel<In, Out><<<blocks, kThreads, smem, stream>>>(static_cast<const In*>(rows), plan.slot_rows,
                                                                plan.tokens, static_cast<int>(plan.topk), hidden,
                                                                plan.out_rows, static_cast<Out*>(out));
  FLEXEP_CUDA_CHECK_LAUNCH("unpermute");
}

}  // namespace

void launch_unpermute(const void* expert_rows, DType rows_dtype, const PlanRefs& plan, std::int64_t hidden, void* out,
                      DType out_dtype, cudaStream_t stream) {
  if (plan.tokens == 0) return;
  const bool in_bf16 = rows_dtype == DType::bf16, out_bf16 = out_dtype == DType::bf16;
  if (in_bf16 && out_bf16) unpermute_as<__nv_bfloat16, __nv_bfloat16>(expert_rows, plan, hidden, out, stream);
  else if (in_bf16) unpermute_as<__nv_bfloat16, float>(expert_rows, plan, hidden, out, stream);
  else if (out_bf16) unpermute_as<float, __nv_bfloat16>(expert_rows, plan, hidden, out, stream);
  else unpermute_as<float, float>(expert_rows, plan, hidden, out, stream);
}

void launch_gather_slot_values(const float* values, const PlanRefs& plan, float* out, cudaStream_t stream) {
  const long long slots = plan.tokens * plan.topk;
  if (slots == 0) return;
  gather_slot_values_kernel<<<static_cast<unsigned>((slots + kSlotThreads - 1) / kSlotThreads), kSlotThreads, 0,
                              stream>>>(values, plan.slot_rows, slots, plan.out_rows, out);
  FLEXEP_CUDA_CHECK_LAUNCH("gather_slot_values");
}

}  // namespace flexep::cuda::permute_detail
