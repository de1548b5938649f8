// Where a dispatch's time goes on the GPU, step by step (HybridEpOptions::kernel_timing): every CTA
// stamps the device clock (%globaltimer, ns) at the end of each step of the preprocess and dispatch
// kernels (or of the fused small-call kernel, which runs both sets of steps in one grid) into the
// earliest and the latest stamp of that step. Events around the kernels give only
// their spans; these show, on each rank, when the count exchange arrived, when the sends were
// published, when the peer's first chunk flag came, and so on (docs/hybridep.md, "The step
// trace").
//
// Shared by the kernels and the host (no CUDA headers); the device stamp is in phase_trace.cuh.
#pragma once

namespace flexep::hybridep {

enum TracePoint : int {
  // preprocess steps (the preprocess kernel, or each CTA of the fused small-call kernel)
  kTracePreprocessStart,  // after the wait for the plan kernel
  kTracePlanned,          // the inline plan of a one-chunk call done
  kTraceCountsSent,       // this rank's counts released to every rank
  kTraceSlotsRanked,      // inline plan: the staged tokens' slot ranks written (fused: none, the
                          // producers' first part ranked), before the wait for the peers' counts
  kTraceCountsArrived,    // every rank's counts here
  kTraceLayoutDone,       // every receiver's layout and the abort decision
  kTracePublished,        // CTA 0: the layout and the decision published (to the host too, blocking)
  kTraceStagingLoaded,    // a staging CTA's first token (fused: each send part's first token):
                          // its rows known
  kTraceStagingStored,    // ... its records and slot entries stored
  kTraceStaged,           // the CTA's staging records written (preprocess kernel only)
  // dispatch roles (dispatch kernel, or the fused kernel after its CTA's own preprocess steps)
  kTraceDispatchStart,    // after the wait for the preprocess grid (fused: the CTA's layout)
  kTraceProducerStart,    // a producer warp begins (rings initialised, the decision read)
  kTraceProbsWritten,     // a send part's local probs written (from the staged records, or fused:
                          // from the staging registers, after the part's row loads are posted)
  kTraceLoadsPosted,      // a send part's row loads posted to the ring (fused: with the rows' notes)
  kTraceRecordsCopied,    // a send part's records stored to every destination (every lane's)
  kTraceFirstJob,         // a consumer received its first job
  kTraceFirstStores,      // a consumer issued the stores of its first row
  kTraceSendsPosted,      // a producer posted its last send job
  kTraceChunkReleased,    // a chunk flag released to every rank (its parts' stores complete)
  kTraceFlagArrived,      // a producer acquired a peer's chunk flag (fan-out)
  kTraceFanOutPosted,     // a producer posted its last job
  kTraceStoresDone,       // a consumer's last stores complete
  kTraceZeroed,           // the unfilled rows zeroed (CTA's slice)
  kTraceDispatchEnd,      // the last CTA to finish
  kTracePoints
};

// The steps' names, in the order of TracePoint (kernel_times().dispatch_phases, bench `step.*`).
inline constexpr const char* kTracePointNames[] = {
    "preprocess_start", "planned",        "counts_sent",    "slots_ranked",   "counts_arrived",
    "layout_done",      "published",      "staging_loaded", "staging_stored", "staged",
    "dispatch_start",   "producer_start", "probs_written",  "loads_posted",   "records_copied",
    "first_job",        "first_stores",   "sends_posted",   "chunk_released", "flag_arrived",
    "fan_out_posted",   "stores_done",    "zeroed",         "dispatch_end",
};
static_assert(sizeof(kTracePointNames) / sizeof(kTracePointNames[0]) == kTracePoints, "a name per trace point");

// first[p] = min and last[p] = max over the stamps of point p; reset before each traced call to
// ~0 and 0 (a point no CTA reached keeps first = ~0).
struct PhaseTrace {
  unsigned long long first[kTracePoints];
  unsigned long long last[kTracePoints];
};

}  // namespace flexep::hybridep
