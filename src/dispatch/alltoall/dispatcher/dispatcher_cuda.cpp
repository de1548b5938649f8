// The alltoall dispatcher's set-up: construction (the optional communication stream and its
// events), the stream helpers every call uses, the first call's handshake, and the factory.
#include "dispatch/alltoall/dispatcher/dispatcher.h"
#include "flexep/core/checks.h"
#include "flexep/core/plan.h"
#include "flexep/cuda/runtime.h"

namespace flexep {
namespace alltoall {

AlltoallDispatcher::AlltoallDispatcher(std::shared_ptr<Communicator> comm, int num_experts,
                                       const AlltoallOptions& options)
    : comm_(std::move(comm)), experts_(num_experts), options_(options), errors_(comm_->device()) {
  if (!options_.separate_stream) return;
  cuda::DeviceGuard device(comm_->device());
  FLEXEP_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&fork_event_, &meta_event_, &join_event_})
    FLEXEP_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
}

AlltoallDispatcher::~AlltoallDispatcher() {
  if (!comm_stream_) return;
  cuda::DeviceGuard device(comm_->device());
  for (cudaEvent_t e : {fork_event_, meta_event_, join_event_})
    if (e) cudaEventDestroy(e);
  cuda::destroy_stream(comm_stream_);
}

cudaStream_t AlltoallDispatcher::stream() const {
  return options_.stream ? options_.stream : cuda::current_stream();
}

cudaStream_t AlltoallDispatcher::fork(cudaStream_t s) {
  if (!comm_stream_) return s;
  FLEXEP_CUDA_CHECK(cudaEventRecord(fork_event_, s));
  FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, fork_event_, 0));
  return comm_stream_;
}

void AlltoallDispatcher::join(cudaStream_t s, cudaEvent_t event) {
  if (!comm_stream_) return;
  FLEXEP_CUDA_CHECK(cudaEventRecord(event, comm_stream_));
  FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(s, event, 0));
}

void AlltoallDispatcher::handshake() {
  if (agreed_) return;
  // Fixed size, so it cannot itself be garbled by a mismatch; the count exchange's size depends on E.
  const std::vector<long long> all = comm_->all_gather_i64({experts_}, "dispatch:handshake");
  for (std::size_t r = 1; r < all.size(); ++r)
    FLEXEP_CHECK_ARG(all[r] == all[0], "num_experts", "rank ", r, " has E=", all[r], " but rank 0 has E=", all[0],
                     "; all ranks must create their dispatcher with the same num_experts");
  agreed_ = true;
}

std::unique_ptr<TokenDispatcher> AlltoallDispatcher::make_sibling(std::int64_t) const {
  return make_alltoall_dispatcher(comm_, experts_, options_);  // sizes its buffers per call
}

}  // namespace alltoall

std::unique_ptr<TokenDispatcher> make_alltoall_dispatcher(std::shared_ptr<Communicator> comm, int num_experts,
                                                          const AlltoallOptions& options) {
  FLEXEP_CHECK_ARG(comm != nullptr, "comm", "is null; create the rank's Communicator first");
  FLEXEP_CHECK_ARG(!comm->simulated(), "comm",
                   "simulates its ranks on one GPU (Communicator::simulate) and has no NCCL communicator; the "
                   "alltoall backend sends through NCCL and needs one rank per GPU");
  PlanParams p;
  p.ranks = comm->size();
  p.experts = num_experts;
  validate(p);  // E >= 1 and divisible by the ranks, named "num_experts"
  return std::make_unique<alltoall::AlltoallDispatcher>(std::move(comm), num_experts, options);
}

}  // namespace flexep
