// Symmetric memory for our own NVLink kernels, on NCCL 2.28's device API:
//   - one ncclMemAlloc allocation registered as an NCCL window with NCCL_WIN_DEFAULT (never the
//     multicast-backed NCCL_WIN_COLL_SYMMETRIC; no multimem anywhere), the same size on every rank;
//   - a device communicator (ncclDevCommCreate) with LSA barriers and one NCCL-managed resource
//     buffer for flags and counters (zeroed once by NCCL, persistent across kernels and graph
//     replays);
//   - the address of every peer's window and flag buffer, resolved once at init with
//     ncclGetLsaPointer / ncclGetResourceBufferLsaPointer by a small kernel and kept twice: in
//     device memory for any number of ranks (SymmetricPeerTable, what deepep's kernels read), and
//     for up to kMaxSymmetricPeers ranks in a SymmetricPeers table that kernels take by value
//     (hybridep's kernels, one lane per rank).
//
// With simulated ranks (Communicator::simulate: R threads on one GPU, which NCCL refuses) the window
// and the flag buffer are plain device allocations of each rank, their addresses exchanged through
// the communicator's host world: the same SymmetricPeers table, no NCCL window and no device
// communicator (dev_comm() and window() are then empty).
//
// All ranks must form one LSA (NVLink) team of consecutive ranks (devComm.lsaSize == size);
// init refuses otherwise, and when the communicator has no symmetric-memory support (probed with
// ncclDevCommCreate before any window is trusted, see docs/hybridep.md).
//
// Life cycle: init() and resize() are collective (same spec on every rank, same order of calls;
// the spec is verified across ranks); free() is collective too: it waits for the device, then for
// every rank (a barrier), then tears down in NCCL's documented order (devComm, window, memory).
// The destructor tears down locally only (no collective): in NCCL 2.28.9 deregistration is local
// and the physical memory lives until the last peer unmaps it, so a rank that goes away alone
// cannot corrupt the others. Graphs that captured kernels using the buffer must be destroyed
// first. Built only with CUDA; include only from *_cuda.cpp and .cu files.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "flexep/comm/communicator.h"

namespace flexep {

// Ranks one buffer serves: one NVLink domain (a GB200 NVL72 domain holds 72).
constexpr int kMaxSymmetricRanks = 1024;
// Ranks of the by-value table below.
constexpr int kMaxSymmetricPeers = 32;

// Base addresses of every rank's window and flag buffer in this process's address space
// (peer r's memory is reached over NVLink; entry [rank] is the local memory through NCCL's flat
// mapping). Entries at and beyond `ranks` are null. Filled for groups of at most
// kMaxSymmetricPeers ranks.
struct SymmetricPeers {
  char* window[kMaxSymmetricPeers];
  char* flags[kMaxSymmetricPeers];
};

// The same addresses for any number of ranks, as two device arrays of `ranks` entries owned by the
// buffer: a kernel argument whose size does not grow with the group.
struct SymmetricPeerTable {
  char* const* window = nullptr;
  char* const* flags = nullptr;
};

struct SymmetricBufferSpec {
  std::size_t window_bytes = 0;  // > 0; registered as one window
  std::size_t flag_bytes = 0;    // NCCL-managed resource buffer (0: none)
  int lsa_barriers = 1;          // LSA barrier slots of the device communicator
};

class SymmetricBuffer {
 public:
  // `name` appears in error messages and phase names ("hybridep dispatch buffer").
  SymmetricBuffer(std::shared_ptr<Communicator> comm, std::string name);
  ~SymmetricBuffer();
  SymmetricBuffer(const SymmetricBuffer&) = delete;
  SymmetricBuffer& operator=(const SymmetricBuffer&) = delete;

  void init(const SymmetricBufferSpec& spec);    // collective
  void resize(const SymmetricBufferSpec& spec);  // collective: free() then init()
  void free();                                   // collective
  bool initialized() const { return local_ != nullptr; }

  const SymmetricBufferSpec& spec() const { return spec_; }
  // Bytes held: the window's allocation (ncclMemAlloc rounds up) plus the flag buffer.
  std::size_t allocated_bytes() const { return allocated_ + (initialized() ? spec_.flag_bytes : 0); }
  void* local() const { return local_; }  // this rank's window (the ncclMemAlloc address)
  // By value, for at most kMaxSymmetricPeers ranks (throws for larger groups).
  const SymmetricPeers& peers() const;
  // In device memory, for any number of ranks.
  SymmetricPeerTable peer_table() const { return {peer_table_, peer_table_ + size()}; }
  // Host copies of the addresses (rank r's window and flag buffer in this process).
  char* peer_window(int r) const { return peer_windows_[static_cast<std::size_t>(r)]; }
  char* peer_flags(int r) const { return peer_flags_[static_cast<std::size_t>(r)]; }
  ncclWindow_t window() const { return window_; }
  const ncclDevComm& dev_comm() const { return dev_comm_; }
  ncclDevResourceHandle_t flag_handle() const { return flag_handle_; }
  Communicator& comm() const { return *comm_; }
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }

 private:
  void init_simulated();
  void publish_peers();  // the host lists into peers_ and the device table
  void teardown_local() noexcept;

  std::shared_ptr<Communicator> comm_;
  std::string name_;
  SymmetricBufferSpec spec_;
  void* local_ = nullptr;
  std::size_t allocated_ = 0;
  ncclWindow_t window_ = nullptr;
  ncclDevComm dev_comm_{};
  bool dev_comm_created_ = false;
  ncclDevResourceHandle_t flag_handle_ = 0;
  SymmetricPeers peers_{};
  std::vector<char*> peer_windows_, peer_flags_;  // [ranks]
  char** peer_table_ = nullptr;                   // device: [ranks] windows, then [ranks] flag buffers
  // Simulated ranks: this rank's window and flag buffer, and every rank's, held like NCCL's peer
  // mappings: memory is freed when the last rank lets go, so a peer's late store never lands in a
  // new allocation at the same address.
  struct SimulatedMemory;
  std::shared_ptr<SimulatedMemory> simulated_;
  std::vector<std::shared_ptr<SimulatedMemory>> simulated_peers_;
};

namespace detail {
// Fills `windows` and `flag_buffers` (host, `ranks` entries each) with the peer addresses of
// `window` and of the resource buffer `flags` (null when has_flags is false), via a kernel on the
// current device (synchronises).
void resolve_symmetric_peers(ncclWindow_t window, const ncclDevComm& dev_comm, ncclDevResourceHandle_t flags,
                             bool has_flags, int ranks, char** windows, char** flag_buffers);
}  // namespace detail

}  // namespace flexep
