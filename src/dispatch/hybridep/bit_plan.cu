// The single-GPU plan of a hybridep dispatch in ONE kernel of one CTA (bit_plan_math.h says how):
// the same counts, offsets and slot rows as the general plan (src/cuda/local_plan*: make keys, a
// CUB radix sort, the layout, the slot rows: 5+ launches, ~68 us before the preprocess kernel on
// dsv3-ep2), for every rank whose (expert x token) bit matrix fits in shared memory.
//
//   1. every thread takes tokens t = tid, tid + 1024, ...: checks the token's ids in slot order
//      (out of range: reported; a repeat of an earlier slot's expert: reported, as the general plan
//      does) and sets bit (e, t) with a shared-memory atomicOr;
//   2. one exclusive scan over the threads of the popcounts of their runs of words;
//   3. counts and offsets per expert, and every slot's row, from the bits and the scan.
// A repeated expert gets the same row twice here (the general plan gives it two): the call is
// aborted anyway (the reported error fails it on every rank), and every row stays below the total.
#include <cub/block/block_scan.cuh>

#include "dispatch/hybridep/bit_plan_math.h"
#include "dispatch/hybridep/kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

namespace {

constexpr int kPlanThreads = 1024;

template <class Index>
__global__ void __launch_bounds__(kPlanThreads, 1)
    bit_plan_kernel(const Index* __restrict__ ids, long long tokens, int k, int experts, long long* __restrict__ counts,
                    long long* __restrict__ begin, int* __restrict__ slot_rows, cuda::DeviceErrorRecord* errors) {
  using Scan = cub::BlockScan<long long, kPlanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ long long run_prefix[kPlanThreads + 1];
  extern __shared__ std::uint32_t bits[];  // [experts * words_per_expert]
  const int tid = threadIdx.x;
  const long long W = bit_plan_words_per_expert(tokens), words = static_cast<long long>(experts) * W;
  for (long long w = tid; w < words; w += kPlanThreads) bits[w] = 0;
  __syncthreads();

  // 1. Bits, and the checks of the general plan's make_sort_keys (same reports).
  for (long long t = tid; t < tokens; t += kPlanThreads) {
    for (int j = 0; j < k; ++j) {
      const long long id = static_cast<long long>(ids[t * k + j]);
      if (id == -1) continue;
      if (id < 0 || id >= experts) {
        cuda::report_device_error(errors, cuda::DeviceArg::indices, t, j, id, experts);
        continue;
      }
      const std::uint32_t bit = bit_plan_bit(t);
      // Only this thread sets token t's bits, in slot order: a bit already set is an earlier slot.
      if (atomicOr(&bits[bit_plan_word(static_cast<int>(id), t, W)], bit) & bit)
        cuda::report_device_error(errors, cuda::DeviceArg::indices, t, j, id, experts);
    }
  }
  __syncthreads();

  // 2. run_prefix[r] = set bits in the words of runs 0..r-1.
  const long long per = bit_plan_per_thread(words, kPlanThreads);
  long long mine = 0;
  for (long long w = tid * per; w < (tid + 1) * per && w < words; ++w) mine += popc32(bits[w]);
  long long before = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(mine, before, total);
  run_prefix[tid] = before;
  if (tid == 0) run_prefix[kPlanThreads] = total;
  __syncthreads();

  // 3. Counts, offsets (pad 1, no budget: the groups are the counts) and the slot rows.
  for (int e = tid; e < experts; e += kPlanThreads) {
    const long long lo = bit_plan_prefix(bits, run_prefix, per, words, e * W);
    const long long hi = bit_plan_prefix(bits, run_prefix, per, words, (e + 1) * W);
    begin[e] = lo;
    counts[e] = hi - lo;
  }
  for (long long t = tid; t < tokens; t += kPlanThreads)
    for (int j = 0; j < k; ++j) {
      const long long id = static_cast<long long>(ids[t * k + j]);
      const bool valid = id >= 0 && id < experts;
      // Rows lie below T * k <= INT32_MAX (the buffer's max_pairs), so the cast is exact.
      slot_rows[t * k + j] =
          valid ? static_cast<int>(bit_plan_row(bits, run_prefix, per, words, static_cast<int>(id), t, W)) : -1;
    }
}

std::size_t bits_bytes(long long tokens, int experts) {
  return static_cast<std::size_t>(experts) * static_cast<std::size_t>(bit_plan_words_per_expert(tokens)) * 4;
}

template <class Index>
void launch(const Index* ids, long long tokens, int k, int experts, long long* counts, long long* begin,
            int* slot_rows, cuda::DeviceErrorRecord* errors, cudaStream_t stream) {
  bit_plan_kernel<Index><<<1, kPlanThreads, bits_bytes(tokens, experts), stream>>>(ids, tokens, k, experts, counts,
                                                                                   begin, slot_rows, errors);
  FLEXEP_CUDA_CHECK_LAUNCH("hybridep bit_plan_kernel");
}

}  // namespace

bool bit_plan_fits(long long tokens, int experts) { return bits_bytes(tokens, experts) <= kBitPlanMaxBytes; }

void prepare_bit_plan() {
  for (const void* kernel : {reinterpret_cast<const void*>(bit_plan_kernel<int>),
                             reinterpret_cast<const void*>(bit_plan_kernel<long long>)})
    FLEXEP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kBitPlanMaxBytes)));
}

void launch_bit_plan(const void* indices, bool indices_i64, long long tokens, int k, int experts, long long* counts,
                     long long* begin, int* slot_rows, cuda::DeviceErrorRecord* errors, cudaStream_t stream) {
  if (indices_i64)
    launch(static_cast<const long long*>(indices), tokens, k, experts, counts, begin, slot_rows, errors, stream);
  else
    launch(static_cast<const int*>(indices), tokens, k, experts, counts, begin, slot_rows, errors, stream);
}

}  // namespace flexep::hybridep
