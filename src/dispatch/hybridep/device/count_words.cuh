// The words of the count exchange, in the format of NCCL's LL protocol: every 8-byte word a rank
// writes into a peer's count slot carries the call's epoch in its upper half and 32 bits of value
// in its lower half, written with one (single-copy atomic) 64-bit store. A reader polls the words
// themselves until each carries the epoch: the writer needs no fence before a flag and no flag, so
// the counts cost one NVLink trip instead of stores, a system fence (which waits for their
// acknowledgements) and a flag behind them.
//
// A slot (layout_math.h, ll_slot_words): the header's 64-bit values as two words each (low half,
// then high half), then one word per expert (pair counts fit in 32 bits: at most max_tokens).
#pragma once

#include <cstdint>

#include "dispatch/hybridep/device/flag.cuh"
#include "dispatch/hybridep/kernels/layout_math.h"

namespace flexep::hybridep {

__device__ __forceinline__ void ll_store(unsigned long long* p, unsigned epoch, unsigned value) {
  const unsigned long long w = (static_cast<unsigned long long>(epoch) << 32) | value;
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}

__device__ __forceinline__ unsigned long long ll_load(const unsigned long long* p) {
  unsigned long long w;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
  return w;
}

// This rank's slot in a count region (ll_slot_words per slot, slot_bytes apart).
__device__ __forceinline__ const unsigned long long* ll_slot(const unsigned char* region, unsigned long long slot_bytes,
                                                             int s) {
  return reinterpret_cast<const unsigned long long*>(region + static_cast<unsigned long long>(s) * slot_bytes);
}

// The words of a slot (the one place that knows their order): header value w's low and high half,
// and expert e's count.
template <class Word>
__device__ __forceinline__ Word* ll_header_word(Word* slot, int w, int half) {
  return slot + 2 * w + half;
}
template <class Word>
__device__ __forceinline__ Word* ll_count_word(Word* slot, int e) {
  return slot + 2 * word::count + e;
}

// Polls the n <= kLlBatch words at `word(0..n-1)` (all loads in flight) until each carries `epoch`,
// then returns their values. False on the deadline (the status then names phase and `peer(i)` of
// the first stale word) or when another wait already timed out. 16 words: an expert's counts from
// up to 16 ranks in one round trip (two at 32), as the reads that summed them before (8 in flight
// made it four at 32 ranks; the preprocess kernel then needs 124 registers instead of 64).
constexpr int kLlBatch = 16;

template <class Word, class Peer>
__device__ bool ll_wait(Word word, int n, unsigned epoch, const WaitContext& w, Peer peer,
                        unsigned (&value)[kLlBatch]) {
  unsigned long long start = 0;
  for (bool first = true;; first = false) {
    unsigned long long got[kLlBatch];
#pragma unroll
    for (int i = 0; i < kLlBatch; ++i)
      if (i < n) got[i] = ll_load(word(i));
    int stale = -1;
    unsigned stale_epoch = 0;  // what the stale word holds (a static index: no local memory)
#pragma unroll
    for (int i = kLlBatch - 1; i >= 0; --i) {
      if (i >= n) continue;
      value[i] = static_cast<unsigned>(got[i]);
      if (static_cast<unsigned>(got[i] >> 32) != epoch) stale = i, stale_epoch = static_cast<unsigned>(got[i] >> 32);
    }
    if (stale < 0) return true;
    if (first) start = global_timer_ns();
    if (timed_out(w.status)) return false;
    if (global_timer_ns() - start > w.timeout_ns) {
      report_status(w.status, StatusCode::timeout, w.phase, peer(stale), epoch, stale_epoch);
      return false;
    }
    __nanosleep(64);
  }
}

}  // namespace flexep::hybridep
