// The NCCL communicator of an expert-parallel group: rank, size, the rank's GPU, its local rank on the
// host and the NVLink domain of every rank. It either creates its own ncclComm_t (from a unique id:
// one process per GPU started by mpirun or any launcher, or one thread per GPU in one process) or
// borrows one (PyTorch's), which it then never destroys.
//
// Every wait has a deadline: communicators are created non-blocking, and `wait` polls the stream and
// ncclCommGetAsyncError until the work is done, NCCL reports an error, or the timeout expires, in
// which case the communicator is aborted and a TimeoutError names the phase. A peer that never
// arrives therefore becomes an error on the others, not a hang.
//
// A communicator can also simulate its ranks (`simulate`): R threads share one GPU and meet through a
// HostWorld, because NCCL refuses two ranks on one GPU. It serves the hybridep kernels, which reach
// their peers through the addresses of a SymmetricBuffer only, so that their multi-rank paths (peer
// flags, remote rows, the combine's second level) run and are tested on a one-GPU machine. It has no
// NCCL communicator: backends that call NCCL (alltoall) refuse it.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <string>
#include <vector>

#include "flexep/comm/process_group.h"

#define FLEXEP_NCCL_CHECK(expr)                                                               \
  do {                                                                                        \
    const ncclResult_t flexep_nr_ = (expr);                                                   \
    if (flexep_nr_ != ncclSuccess && flexep_nr_ != ncclInProgress)                            \
      ::flexep::throw_nccl_error(flexep_nr_, #expr, __FILE__, __LINE__);                      \
  } while (0)

namespace flexep {

class HostWorld;

[[noreturn]] void throw_nccl_error(ncclResult_t r, const char* expr, const char* file, int line);

// Refuses (flexep::Error naming both versions) when the libnccl loaded at run time differs from the
// headers flexep was built against: NCCL 2.28's device structures carry no version.
void check_nccl_version();
// NVLink multicast must stay off (it can take shared hosts' GPUs out of service): sets
// NCCL_NVLS_ENABLE=0 when unset, refuses when it is set to anything else.
void ensure_no_multicast();

std::string unique_id_to_hex(const ncclUniqueId& id);
ncclUniqueId unique_id_from_hex(const std::string& hex);

struct CommunicatorOptions {
  double timeout_seconds = 300.0;
  int ranks_per_domain = 0;  // > 0: split each host into NVLink domains of this many ranks (tests)
};

class Communicator : public ProcessGroup {
 public:
  // Collective over `size` ranks sharing `id`; `device` is this rank's GPU.
  static std::unique_ptr<Communicator> create(const ncclUniqueId& id, int rank, int size, int device,
                                              const CommunicatorOptions& options = {});
  // One process driving `devices` with one thread each: call from each thread with its index.
  // (Convenience over create(): the id is made once and shared.)
  static ncclUniqueId new_unique_id();
  // Process-per-GPU launch: rank/size/local rank from OpenMPI's environment (or FLEXEP_RANK,
  // FLEXEP_WORLD_SIZE, FLEXEP_LOCAL_RANK), the id from FLEXEP_NCCL_ID (hex) or the file named by
  // FLEXEP_NCCL_ID_FILE (rank 0 writes it, the others wait for it), device = local rank.
  static std::unique_ptr<Communicator> from_environment(const CommunicatorOptions& options = {});
  // Borrows `comm` (not destroyed here); `device` is the GPU it was created on.
  static std::unique_ptr<Communicator> borrow(ncclComm_t comm, int device, const CommunicatorOptions& options = {});
  // Rank `rank` of world->size() simulated ranks, all on GPU `device`, one thread each. Kernels of
  // different ranks wait for each other on one GPU, so lazy module loading (which may wait for the
  // running kernels) must be off: refuses unless CUDA_MODULE_LOADING=EAGER took effect.
  static std::unique_ptr<Communicator> simulate(std::shared_ptr<HostWorld> world, int rank, int device,
                                                const CommunicatorOptions& options = {});

  ~Communicator() override;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const { return device_; }
  int local_rank() const { return local_rank_; }
  // NVLink domain of every rank (ranks of one domain reach each other by load/store).
  const std::vector<int>& domains() const { return domain_of_rank_; }
  int domain(int rank) const { return domain_of_rank_.at(static_cast<std::size_t>(rank)); }
  // The NCCL communicator; a simulated one has none and refuses, naming the caller's need.
  ncclComm_t get() const;
  bool simulated() const { return world_ != nullptr; }
  // The world simulated ranks meet in (null for real ones): tests inject faults into its collectives.
  const std::shared_ptr<HostWorld>& simulated_world() const { return world_; }
  // SMs this rank's kernels may take: the GPU's, or with R simulated ranks on one GPU 1 / (2R) of
  // them, so that every rank's preprocess and dispatch grids (which may overlap) are resident at once.
  int sms_per_rank() const;
  // For backends whose kernels wait for each other's: with simulated ranks each rank's stream needs
  // a hardware queue of its own, or one rank's kernel queues behind another's that waits for it.
  // The GPU has CUDA_DEVICE_MAX_CONNECTIONS of them (8 unless set before CUDA starts, 32 at most);
  // refuses more simulated ranks with an ArgumentError naming `backend`. Nothing for real ranks.
  void require_queue_per_rank(const std::string& backend) const;
  double timeout_seconds() const { return options_.timeout_seconds; }
  bool aborted() const { return aborted_; }

  // Waits for `stream` with the deadline; on NCCL error or timeout aborts and throws (naming phase).
  void wait(cudaStream_t stream, const std::string& phase);
  // Waits until NCCL calls issued in non-blocking mode have been enqueued (ncclInProgress cleared).
  void wait_enqueued(const std::string& phase);

  // ProcessGroup: device tensors (f32, f64, i64, i32) or CPU tensors (staged through the GPU), on the
  // thread's current stream (cuda::current_stream()), waited for with the deadline.
  void all_reduce_sum(const TensorView& t, const std::string& what) override;
  void barrier(const std::string& what) override;
  // Gathers `count` int64 from every rank into out [size * count] (host vectors; blocking).
  std::vector<long long> all_gather_i64(const std::vector<long long>& mine, const std::string& what);

 private:
  Communicator(ncclComm_t comm, bool owned, int device, const CommunicatorOptions& options);
  Communicator(std::shared_ptr<HostWorld> world, int rank, int device, const CommunicatorOptions& options);
  void discover_topology();
  [[noreturn]] void fail(const std::string& phase, const std::string& why, bool timeout);

  ncclComm_t comm_ = nullptr;
  std::shared_ptr<HostWorld> world_;  // simulated ranks only
  bool owned_ = false;
  bool aborted_ = false;
  int rank_ = 0, size_ = 1, device_ = 0, local_rank_ = 0;
  CommunicatorOptions options_;
  std::vector<int> domain_of_rank_;
};

}  // namespace flexep
