// The `alltoall` backend of the TokenDispatcher (Automodel's `torch` dispatcher; `torch` is its
// alias): tokens move between GPUs with NCCL grouped ncclSend/ncclRecv, one message per peer and
// direction, after an ncclAllGather of the per-expert and per-rank counts.
//
// Per call on each rank (one GPU, one dispatcher object per rank):
//   dispatch:  count kernel -> ONE ncclAllGather of [header | counts per expert | tokens per rank]
//              (the first call also exchanges E once) -> host sync, every rank builds the same
//              DispatchPlan (core/plan.h) -> each token is packed once per destination rank with
//              its (local expert, prob) pairs -> grouped send/recv -> the receiver scatters the rows
//              expert-major, exactly in the host backend's order and padding;
//   combine:   per received row, its kept expert rows summed in fp32 over ascending local expert and
//              rounded to bf16 -> sent back -> per token, the partials summed in fp32 over ascending
//              owner rank and rounded: the two-level sum of docs/semantics.md, so the result is
//              bitwise equal to the host backend's;
//   backwards: combine_backward packs grad_out like the dispatch (no count exchange, no planning);
//              dispatch_backward is a combine whose return messages also carry each slot's prob grad.
//
// Host synchronisation: every call waits for its NCCL work on the host, through
// Communicator::wait, so that a rank that stops participating becomes a TimeoutError naming the
// phase ("dispatch:count-exchange", "dispatch:tokens", "combine:checks", "combine:partials", ...) within the
// communicator's timeout instead of a hang. dispatch also needs the counts on the host to size the
// NCCL messages, in budget mode too (budget mode fixes the output size and keeps tokens_per_expert
// on the device, but is not sync-free here: only the hybridep backend is).
//
// Errors: argument errors found on one rank (host checks, or bad expert ids found by the count
// kernel) travel with the count exchange and are raised on every rank, as are configuration
// mismatches (E, routing form, H, k, mode, pad_multiple, budget) and budget overflow. combine and
// the backwards exchange no counts, so each first gathers every rank's verdict on its own arguments
// (one word per rank, phase "<call>:checks"; a host synchronisation) and raises one rank's
// ArgumentError on every rank, naming that rank and the argument. All ranks must pass the handle of
// the same dispatch call, since the message sizes come from it.
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "flexep/comm/communicator.h"
#include "flexep/dispatch/dispatcher.h"

namespace flexep {

struct AlltoallOptions {
  // Issue the NCCL work on an internal stream, ordered after the caller's stream with events and
  // joined back before each call returns. What overlaps: in dispatch, zero-filling the outputs and
  // computing the expert-major positions of the received rows (which needs only the small metadata
  // message) run on the caller's stream while the token rows are still in flight. The other calls
  // have nothing to overlap inside one call; the stream only keeps NCCL off the caller's stream.
  bool separate_stream = false;
  // The stream work is issued on and outputs are allocated on. nullptr: the calling thread's
  // cuda::current_stream() at each call.
  cudaStream_t stream = nullptr;
};

// `comm` is this rank's communicator (its GPU is where inputs must live); num_experts is E, a
// multiple of comm->size(). The dispatcher keeps `comm` alive.
std::unique_ptr<TokenDispatcher> make_alltoall_dispatcher(std::shared_ptr<Communicator> comm, int num_experts,
                                                          const AlltoallOptions& options = {});

}  // namespace flexep
