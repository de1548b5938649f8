// Kernels of plan_local. The plan is built from a stable sort of the pairs by expert id:
//   1. make_sort_keys: one thread per pair (t, j): key = expert id (E for -1 and bad ids), value = t*k + j;
//   2. CUB stable radix sort (local_plan_sort.cu): pairs of one expert end up in pair-index order;
//   3. build_layout: one block; each expert's sorted range by binary search, then the padded offsets
//      (a block scan), the budget cut and the totals, exactly as DispatchPlan::build with R = 1;
//   4. write_slot_rows: one thread per sorted position: its row is the group start plus its rank in the
//      group, or -1 when the budget dropped it.
// Everything is integer arithmetic in a fixed order, so the plan is deterministic.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "flexep/cuda/runtime.h"
#include "cuda/local_plan_launch.h"

namespace flexep::cuda::local_plan_detail {

namespace {

constexpr int kPairThreads = 256;
constexpr int kLayoutThreads = 256;

__device__ __forceinline__ long long round_up(long long x, long long m) { return (x + m - 1) / m * m; }

__device__ __forceinline__ long long clamp_ll(long long x, long long lo, long long hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// First position p in the sorted keys with keys[p] >= value (n when none).
__device__ __forceinline__ long long lower_bound(const std::uint32_t* keys, long long n, std::uint32_t value) {
  long long lo = 0, hi = n;
  while (lo < hi) {
    const long long mid = lo + (hi - lo) / 2;
    if (keys[mid] < value) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

template <class Index>
__global__ void __launch_bounds__(kPairThreads)
    make_sort_keys_kernel(const Index* __restrict__ ids, long long n, int k, int experts,
                          std::uint32_t* __restrict__ keys, std::int32_t* __restrict__ pairs,
                          DeviceErrorRecord* errors) {
  const long long i = static_cast<long long>(blockIdx.x) * kPairThreads + threadIdx.x;
  if (i >= n) return;
  const long long id = static_cast<long long>(ids[i]);
  const long long t = i / k;
  const int j = static_cast<int>(i - t * k);
  const bool valid = id >= 0 && id < experts;
  if (!valid && id != -1) report_device_error(errors, DeviceArg::indices, t, j, id, experts);
  if (valid) {
    // A repeated expert would get two rows of the same token: report it (the layout stays well defined).
    for (int jj = 0; jj < j; ++jj)
      if (static_cast<long long>(ids[t * k + jj]) == id) {
        report_device_error(errors, DeviceArg::indices, t, j, id, experts);
        break;
      }
  }
  keys[i] = valid ? static_cast<std::uint32_t>(id) : static_cast<std::uint32_t>(experts);
  pairs[i] = static_cast<std::int32_t>(i);
}

__global__ void __launch_bounds__(kLayoutThreads)
    build_layout_kernel(const std::uint32_t* __restrict__ sorted_keys, long long n, Layout layout,
                        std::int64_t* __restrict__ sorted_begin, Outputs out, DeviceErrorRecord* errors) {
  using Scan = cub::BlockScan<long long, kLayoutThreads>;
  using Reduce = cub::BlockReduce<long long, kLayoutThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ typename Reduce::TempStorage reduce_storage;
  __shared__ long long carry;  // rows of the groups of the chunks done so far
  const int tid = threadIdx.x;
  const int E = layout.experts;
  const long long m = layout.pad_multiple;

  // Pass 1: real counts (kept_rows holds them until pass 2) and padded group offsets, in chunks of
  // kLayoutThreads experts. Expert e is always handled by thread e % kLayoutThreads, in both passes.
  if (tid == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < E; base += kLayoutThreads) {
    const int e = base + tid;
    long long real = 0;
    if (e < E) {
      const long long lo = lower_bound(sorted_keys, n, static_cast<std::uint32_t>(e));
      const long long hi = lower_bound(sorted_keys, n, static_cast<std::uint32_t>(e) + 1u);
      sorted_begin[e] = lo;
      real = hi - lo;
      out.kept_rows[e] = real;
    }
    long long offset = 0, chunk_rows = 0;
    Scan(scan_storage).ExclusiveSum(round_up(real, m), offset, chunk_rows);
    if (e < E) out.expert_begin[e] = carry + offset;
    __syncthreads();  // every thread has read carry, and scan_storage may be reused
    if (tid == 0) carry += chunk_rows;
    __syncthreads();
  }
  const long long required = carry;
  const bool budget_mode = layout.budget >= 0;
  const long long out_rows = budget_mode ? layout.budget : required;

  // Pass 2: the budget keeps the prefix of rows below it (core/plan.cpp); the clamps are no-ops
  // when everything fits.
  long long my_dropped = 0, my_used = 0;
  for (int e = tid; e < E; e += kLayoutThreads) {
    const long long begin = out.expert_begin[e];
    const long long real = out.kept_rows[e];
    const long long kept = budget_mode ? clamp_ll(out_rows - begin, 0, real) : real;
    const long long group = clamp_ll(out_rows - begin, 0, round_up(kept, m));
    out.kept_rows[e] = kept;
    out.tokens_per_expert[e] = group;
    my_dropped += real - kept;
    my_used += group;
  }
  const long long dropped = Reduce(reduce_storage).Sum(my_dropped);
  __syncthreads();  // reduce_storage is reused
  const long long used = Reduce(reduce_storage).Sum(my_used);
  if (tid == 0) {
    *out.dropped = dropped;
    *out.used_rows = used;
    if (budget_mode && required > layout.budget && !layout.drop)
      report_device_error(errors, DeviceArg::budget_rows, 0, -1, required, layout.budget);
  }
}

__global__ void __launch_bounds__(kPairThreads)
    write_slot_rows_kernel(const std::uint32_t* __restrict__ sorted_keys, const std::int32_t* __restrict__ sorted_pairs,
                           long long n, int experts, const std::int64_t* __restrict__ sorted_begin,
                           const std::int64_t* __restrict__ expert_begin, const std::int64_t* __restrict__ kept_rows,
                           std::int32_t* __restrict__ slot_rows) {
  const long long p = static_cast<long long>(blockIdx.x) * kPairThreads + threadIdx.x;
  if (p >= n) return;
  const std::uint32_t e = sorted_keys[p];
  std::int32_t row = -1;
  if (e < static_cast<std::uint32_t>(experts)) {
    const long long rank = p - sorted_begin[e];  // position among the pairs of expert e
    // Kept rows lie below out_rows <= INT32_MAX (checked on the host), so the cast is exact.
    if (rank < kept_rows[e]) row = static_cast<std::int32_t>(expert_begin[e] + rank);
  }
  slot_rows[sorted_pairs[p]] = row;  // sorted_pairs is a permutation of [0, n): each slot written once
}

unsigned blocks_for(long long n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

}  // namespace

void launch_make_sort_keys(const void* indices, DType index_dtype, std::int64_t tokens, int topk, int experts,
                           const Workspace& ws, DeviceErrorRecord* errors, cudaStream_t stream) {
  const long long n = tokens * topk;
  if (n == 0) return;
  if (index_dtype == DType::i32)
    make_sort_keys_kernel<std::int32_t><<<blocks_for(n, kPairThreads), kPairThreads, 0, stream>>>(
        static_cast<const std::int32_t*>(indices), n, topk, experts, ws.keys_in, ws.pairs_in, errors);
  else
    make_sort_keys_kernel<std::int64_t><<<blocks_for(n, kPairThreads), kPairThreads, 0, stream>>>(
        static_cast<const std::int64_t*>(indices), n, topk, experts, ws.keys_in, ws.pairs_in, errors);
  FLEXEP_CUDA_CHECK_LAUNCH("make_sort_keys");
}

void launch_build_layout(const Workspace& ws, std::int64_t n, const Layout& layout, const Outputs& out,
                         DeviceErrorRecord* errors, cudaStream_t stream) {
  build_layout_kernel<<<1, kLayoutThreads, 0, stream>>>(ws.keys_out, n, layout, ws.sorted_begin, out, errors);
  FLEXEP_CUDA_CHECK_LAUNCH("build_layout");
}

void launch_write_slot_rows(const Workspace& ws, std::int64_t n, int experts, const Outputs& out,
                            cudaStream_t stream) {
  if (n == 0) return;
  write_slot_rows_kernel<<<blocks_for(n, kPairThreads), kPairThreads, 0, stream>>>(
      ws.keys_out, ws.pairs_out, n, experts, ws.sorted_begin, out.expert_begin, out.kept_rows, out.slot_rows);
  FLEXEP_CUDA_CHECK_LAUNCH("write_slot_rows");
}

int sort_key_bits(int experts) {
  int bits = 1;
  while (bits < 32 && (static_cast<std::uint32_t>(experts) >> bits) != 0u) ++bits;
  return bits;
}

}  // namespace flexep::cuda::local_plan_detail
