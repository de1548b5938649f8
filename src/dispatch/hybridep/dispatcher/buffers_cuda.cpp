#include <cmath>

#include "dispatch/common/device_deadline.h"
#include "dispatch/hybridep/dispatcher/buffers.h"
#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

namespace {
// Plain device memory next to a window, zeroed: OpControl epochs start at 0 like NCCL's flags.
char* allocate_zeroed(std::size_t bytes, int device) {
  cuda::DeviceGuard guard(device);
  void* p = nullptr;
  FLEXEP_CUDA_CHECK(cudaMalloc(&p, bytes));
  FLEXEP_CUDA_CHECK(cudaMemset(p, 0, bytes));
  FLEXEP_CUDA_CHECK(cudaDeviceSynchronize());
  return static_cast<char*>(p);
}

void free_local(char* p, int device) noexcept {
  if (!p) return;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  cudaDeviceSynchronize();  // no kernel may still use it
  cudaFree(p);
  cudaSetDevice(previous);
}

// Returns a buffer's zeroed plain device memory, then sets up its window and flags (collective, one
// LSA barrier); the memory is freed again when that fails. The zeroing synchronises the device, so
// it comes before the barrier: after it, a faster rank may launch kernels that wait for this one
// (on one GPU, with simulated ranks, this rank's synchronisation would then wait for them).
char* init_symmetric_and_local(SymmetricBuffer& sym, std::size_t window_bytes, std::size_t flag_bytes,
                               std::size_t local_bytes) {
  char* local = allocate_zeroed(local_bytes, sym.comm().device());
  SymmetricBufferSpec spec;
  spec.window_bytes = window_bytes;
  spec.flag_bytes = flag_bytes;
  spec.lsa_barriers = 1;
  try {
    sym.init(spec);
  } catch (...) {
    free_local(local, sym.comm().device());
    throw;
  }
  return local;
}
}  // namespace

DispatchStorage::DispatchStorage(std::shared_ptr<Communicator> comm, const BufferConfig& config)
    : geo_(dispatch_geometry(config)),
      sym_(comm, "hybridep dispatch buffer") {
  local_ = init_symmetric_and_local(sym_, geo_.window_bytes, geo_.flag_bytes, geo_.local_bytes);
  prepare_preprocess(config.experts);
  prepare_dispatch();
  prepare_chunk_plan(config.experts);
}

DispatchStorage::~DispatchStorage() { free_local(local_, sym_.comm().device()); }

DispatchView DispatchStorage::view(Status* status, double timeout_seconds) const {
  const BufferConfig& c = geo_.cfg;
  DispatchView v;
  v.peers = sym_.peers();
  v.rank = sym_.rank();
  v.ranks = c.ranks;
  v.experts = c.experts;
  v.local_experts = c.local_experts();
  v.owner = OwnerOf::for_local_experts(v.local_experts);
  v.width = geo_.width;
  v.record_bytes = geo_.record_bytes;
  v.max_chunks = geo_.max_chunks;
  v.max_tokens = c.max_tokens;
  v.hidden = c.hidden;
  v.capacity_rows = c.capacity_rows;
  v.off_counts = geo_.off_counts;
  v.slot_bytes = geo_.slot_bytes;
  v.off_records = geo_.off_records;
  v.off_probs = geo_.off_probs;
  v.off_tokens = geo_.off_tokens;
  v.off_scales = geo_.off_scales;
  v.control = control();
  v.tpe = at<long long>(geo_.off_tpe);
  v.begin = at<long long>(geo_.off_begin);
  v.kept = at<long long>(geo_.off_kept);
  v.snapshot = at<long long>(geo_.off_snapshot);
  v.staging = at<unsigned char>(geo_.off_staging);
  v.slot_entry = at<int>(geo_.off_slot_entry);
  v.work = at<unsigned>(geo_.off_work);
  v.status = status;
  v.timeout_ns = device_timeout_ns(timeout_seconds);
  return v;
}

CombineStorage::CombineStorage(std::shared_ptr<Communicator> comm, const BufferConfig& config)
    : geo_(combine_geometry(config)), sym_(comm, "hybridep combine buffer") {
  local_ = init_symmetric_and_local(sym_, geo_.window_bytes, geo_.flag_bytes, geo_.local_bytes);
  prepare_combine();
  prepare_combine_backward();
}

CombineStorage::~CombineStorage() { free_local(local_, sym_.comm().device()); }

CombineView CombineStorage::view(Status* status, double timeout_seconds) const {
  const BufferConfig& c = geo_.cfg;
  CombineView v;
  v.peers = sym_.peers();
  v.rank = sym_.rank();
  v.ranks = c.ranks;
  v.width = geo_.width;
  v.max_chunks = geo_.max_chunks;
  v.max_tokens = c.max_tokens;
  v.hidden = c.hidden;
  v.off_partials = geo_.off_partials;
  v.off_grads = geo_.off_grads;
  v.flag_ready = static_cast<int>(geo_.flag_ready);
  v.flag_consumed = static_cast<int>(geo_.flag_consumed);
  v.flag_abort = static_cast<int>(geo_.flag_abort);
  v.flag_abort_arg = static_cast<int>(geo_.flag_abort_arg);
  v.control = reinterpret_cast<OpControl*>(local_ + geo_.off_control);
  v.work = reinterpret_cast<unsigned*>(local_ + geo_.off_work);
  v.status = status;
  v.timeout_ns = device_timeout_ns(timeout_seconds);
  return v;
}

}  // namespace flexep::hybridep
