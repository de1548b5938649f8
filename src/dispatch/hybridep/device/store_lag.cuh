// The bookkeeping of a store warp (dispatch.cu's consumer, combine_backward.cu's
// store warp), kept by lane 0 after it has issued each job's bulk stores:
//   - one bulk group per job (also for a job without stores, so that group counts are job counts);
//   - a stage is freed once the stores of kFreeLag newer jobs are issued and its own stores have
//     read it (`wait_group.read kFreeLag`), so a ring needs more than kFreeLag stages;
//   - a finished part ("part end" job) is published kReleaseLag jobs later, at the next part end,
//     or at a "flush" job, whichever comes first, so that the ring never drains while its stores
//     complete. publish(chunk, parts_per_chunk, since) waits for all but the newest `since` groups
//     and releases the part (each kernel knows its own flags).
#pragma once

#include "dispatch/hybridep/device/ring.cuh"
#include "dispatch/hybridep/device/tma.cuh"

namespace flexep::hybridep {

constexpr int kFreeLag = 2;     // the newest jobs' stores may still be reading their stages
constexpr int kReleaseLag = 4;  // a finished part is published after this many newer jobs

class StoreLag {
 public:
  // `free_lag`: a stage is freed once this many newer jobs have been issued (at least kFreeLag;
  // more when a later job's group also reads it: the fused dispatch's held local rows).
  __device__ explicit StoreLag(int free_lag = kFreeLag) : free_lag_(free_lag) {}

  // Lane 0, after issuing the stores of job j. A part end names its chunk and parts per chunk.
  template <class Publish>
  __device__ void after_job(const Ring& ring, unsigned j, bool part_end, bool flush, int chunk, int parts,
                            Publish publish) {
    tma::commit();
    if (pending_ >= 0) ++since_;
    if (part_end) {
      if (pending_ >= 0) publish(pending_, pending_parts_, since_);
      pending_ = chunk, pending_parts_ = parts, since_ = 0;
    } else if (pending_ >= 0 && (since_ >= kReleaseLag || flush)) {
      publish(pending_, pending_parts_, since_);
      pending_ = -1;
    }
    tma::wait_groups_read<kFreeLag>();
    for (; freed_ + free_lag_ <= j; ++freed_) ring.release(freed_);
  }
  // Lane 0, after the last job: every store complete (nothing may read the ring when the CTA
  // exits), the last part published.
  template <class Publish>
  __device__ void finish(Publish publish) {
    tma::wait_groups<0>();
    if (pending_ >= 0) publish(pending_, pending_parts_, 0);
  }

 private:
  int free_lag_;
  unsigned freed_ = 0;
  int pending_ = -1, pending_parts_ = 0, since_ = 0;  // a part whose stores may still be in flight
};

}  // namespace flexep::hybridep
