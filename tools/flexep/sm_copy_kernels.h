// Probes of one SM's copy paths, for `flexep bench sm-copy`: how many bytes per second a CTA moves
// between its shared memory and HBM with the bulk-copy unit (cp.async.bulk, one or more issuing
// threads, a given number of copies in flight each), with ordinary 16-byte stores by W warps, with
// ordinary 16-byte loads by W warps (U loads in flight per lane, summed as the combine sums rows),
// and with bulk loads and warp loads at the same time. The hybridep
// kernels are built from exactly these paths (docs/hybridep.md, "Where the time goes").
#pragma once

#include <cuda_runtime.h>

namespace flexep::tools {

struct SmCopyParams {
  unsigned char* dst = nullptr;        // HBM rows (bulk store, warp store)
  const unsigned char* src = nullptr;  // HBM rows (bulk load, warp load)
  long long rows = 0;                  // rows in the HBM buffer (row r of copy i: i * grid + cta, mod rows)
  int row_bytes = 0;                   // a multiple of 16
  int copies = 0;                      // rows each CTA moves
  int in_flight = 1;                   // bulk: copies in flight (shared-memory stages); warp load: per lane
  int warps = 1;                       // warp store / load: warps per CTA
  float* sink = nullptr;               // warp load: one float per CTA, so that the loads are not dead code
  bool l2_only = false;                // warp load: ld.global.cg instead of the read-only path (ld.global.nc)
  int issuers = 1;                     // bulk load: threads (of different warps) issuing, each its own stages
  int issuer_warp_step = 1;            // bulk load: issuer i is lane 0 of warp i * step (4: one sub-partition); 0: lane i of warp 0
  int bulk_copies = 0;                 // mixed load: rows one thread bulk-loads while the warps load `copies`
  int pipes = 0;                       // ring load: pipelines per CTA (1 to 3)
  bool read_stages = true;             // ring load: the consumers read every stage (else only free it)
  int store_every = 0;                 // ring load: the consumers also store one row per this many (0: none)
  long long src_rows = 0;              // warp copy: rows of the source (0: rows); few enough stay in L2
};

// Dynamic shared memory each probe needs.
std::size_t sm_copy_smem_bytes(const SmCopyParams& p);
void launch_bulk_store_probe(const SmCopyParams& p, int sms, cudaStream_t stream);
void launch_bulk_load_probe(const SmCopyParams& p, int sms, cudaStream_t stream);
void launch_warp_store_probe(const SmCopyParams& p, int sms, cudaStream_t stream);
void launch_warp_load_probe(const SmCopyParams& p, int sms, cudaStream_t stream);
// Both load paths at once: warps 0..W-1 load and sum `copies` rows (8 per lane in flight) while one
// thread of the last warp bulk-loads `bulk_copies` other rows (`in_flight` stages): whether the
// bulk-copy unit and the warps' loads share one limit per SM or add up.
void launch_mixed_load_probe(const SmCopyParams& p, int sms, cudaStream_t stream);
// The combine kernel's data path alone: `pipes` pipelines per CTA, each a producer warp whose lane
// 0 bulk-loads whole rows into a hybridep::Ring (as deep as shared memory allows, at most 8 stages)
// and 4 consumer warps that read every stage with 16-byte shared loads (or, with read_stages off,
// only free it), and with store_every k also store one row (their xor of the last k) per k rows, as
// the combine writes one partial per token. Against bulk-load-issuers: what the consumers, the ring
// handshake and the consumers' stores cost the loads.
void launch_ring_load_probe(const SmCopyParams& p, int sms, cudaStream_t stream);
// deepep's row copy (device/copy_row.cuh) alone: W warps each copy whole rows from `src` (row i mod
// src_rows) to `dst` (row i mod rows), `in_flight` 16-byte loads per lane before their stores.
// Pointing `dst` at an NCCL window, or `src` at a few rows that stay in L2, tells whether the
// destination's memory or the HBM loads limit a copy per SM.
void launch_warp_copy_probe(const SmCopyParams& p, int sms, cudaStream_t stream);

}  // namespace flexep::tools
