#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "flexep/comm/symmetric_buffer.h"
#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"

namespace flexep {

namespace {
// Teardown helper: lets a non-blocking NCCL call finish, for at most `seconds` (never throws).
void settle(ncclComm_t comm, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  ncclResult_t state = ncclInProgress;
  while (ncclCommGetAsyncError(comm, &state) == ncclSuccess && state == ncclInProgress &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::yield();
}
}  // namespace

SymmetricBuffer::SymmetricBuffer(std::shared_ptr<Communicator> comm, std::string name)
    : comm_(std::move(comm)), name_(std::move(name)) {
  FLEXEP_CHECK_ARG(comm_ != nullptr, "comm", "is null; create the rank's Communicator first");
}

SymmetricBuffer::~SymmetricBuffer() { teardown_local(); }

void SymmetricBuffer::init(const SymmetricBufferSpec& spec) {
  FLEXEP_CHECK(!initialized(), name_, ": init() called twice; use resize() to change the size");
  FLEXEP_CHECK_ARG(spec.window_bytes > 0, "window_bytes", "must be > 0");
  FLEXEP_CHECK_ARG(spec.lsa_barriers >= 0, "lsa_barriers", "must be >= 0, got ", spec.lsa_barriers);
  FLEXEP_CHECK(!comm_->aborted(), name_, ": the communicator was aborted after an earlier failure");
  cuda::init();
  cuda::DeviceGuard guard(comm_->device());
  const int R = comm_->size(), me = comm_->rank();
  FLEXEP_CHECK_ARG(R <= kMaxSymmetricRanks, "comm", name_, " supports at most ", kMaxSymmetricRanks,
                   " ranks in one NVLink domain, the communicator has ", R);

  // Windows must have the same size on every rank (NCCL 2.28.9 maps each peer's allocation with the
  // local size): every rank checks every rank, so all raise the same error together.
  const std::vector<long long> all = comm_->all_gather_i64(
      {static_cast<long long>(spec.window_bytes), static_cast<long long>(spec.flag_bytes), spec.lsa_barriers},
      name_ + ":init");
  for (int r = 1; r < R; ++r)
    for (int i = 0; i < 3; ++i)
      FLEXEP_CHECK_ARG(all[static_cast<std::size_t>(r * 3 + i)] == all[static_cast<std::size_t>(i)], "options", name_,
                       ": rank ", r, " asks for a buffer of ", all[static_cast<std::size_t>(r * 3)], " + ",
                       all[static_cast<std::size_t>(r * 3 + 1)], " bytes but rank 0 for ", all[0], " + ", all[1],
                       "; all ranks must size their buffers alike (same options, same number of experts)");
  spec_ = spec;
  if (comm_->simulated()) return init_simulated();
  try {
    // 1. The device communicator first: its creation fails cleanly when the communicator has no
    //    symmetric-memory support, whereas a window registration would "succeed" with a useless
    //    handle (docs/hybridep.md). The requirements struct is zeroed (NCCL 2.28 has no initializer).
    ncclDevResourceRequirements_t flags{};
    ncclDevCommRequirements_t reqs{};
    if (spec.flag_bytes) {
      flags.bufferSize = spec.flag_bytes;
      flags.bufferAlign = 128;
      flags.outBufferHandle = &flag_handle_;
      reqs.resourceRequirementsList = &flags;
    }
    reqs.lsaBarrierCount = spec.lsa_barriers;  // never multimem: lsaMultimem stays false
    const ncclResult_t created = ncclDevCommCreate(comm_->get(), &reqs, &dev_comm_);
    if (created != ncclSuccess && created != ncclInProgress)
      throw_error(name_, ": ncclDevCommCreate failed (", ncclGetErrorString(created),
                  "): this NCCL communicator has no symmetric-memory support; hybridep needs CUDA peer access "
                  "between all GPUs of the group, cuMem (NCCL_CUMEM_ENABLE unset or 1) and NCCL_WIN_ENABLE=1");
    comm_->wait_enqueued(name_ + ":ncclDevCommCreate");
    dev_comm_created_ = true;
    FLEXEP_CHECK(dev_comm_.lsaSize == R && dev_comm_.lsaRank == me, name_, ": rank ", me, " is LSA rank ",
                 dev_comm_.lsaRank, " of an LSA team of ", dev_comm_.lsaSize, " ranks; hybridep needs all ", R,
                 " ranks in one NVLink domain, numbered consecutively");

    // 2. The window: one ncclMemAlloc allocation (a window must lie inside one cuMem allocation in
    //    2.28.9), registered with NCCL_WIN_DEFAULT.
    FLEXEP_NCCL_CHECK(ncclMemAlloc(&local_, spec.window_bytes));
    allocated_ = spec.window_bytes;
    FLEXEP_NCCL_CHECK(ncclCommWindowRegister(comm_->get(), local_, spec.window_bytes, &window_, NCCL_WIN_DEFAULT));
    comm_->wait_enqueued(name_ + ":ncclCommWindowRegister");

    // 3. Zero the window: records and flags compare epochs, and stale bytes must never look like a
    //    current epoch. Then resolve the peer addresses.
    FLEXEP_CUDA_CHECK(cudaMemset(local_, 0, spec.window_bytes));
    FLEXEP_CUDA_CHECK(cudaDeviceSynchronize());
    peer_windows_.assign(static_cast<std::size_t>(R), nullptr);
    peer_flags_.assign(static_cast<std::size_t>(R), nullptr);
    detail::resolve_symmetric_peers(window_, dev_comm_, flag_handle_, spec.flag_bytes != 0, R, peer_windows_.data(),
                                    peer_flags_.data());
    publish_peers();

    // 4. No rank may write into a peer's window before that peer has zeroed it.
    comm_->barrier(name_ + ":init");
  } catch (...) {
    teardown_local();
    throw;
  }
}

struct SymmetricBuffer::SimulatedMemory {
  int device = 0;
  void* window = nullptr;
  void* flags = nullptr;
  ~SimulatedMemory() {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    if (window) cudaFree(window);  // synchronises the device: no kernel still uses it
    if (flags) cudaFree(flags);
    cudaSetDevice(previous);
  }
};

void SymmetricBuffer::init_simulated() {
  try {
    simulated_ = std::make_shared<SimulatedMemory>();
    simulated_->device = comm_->device();
    FLEXEP_CUDA_CHECK(cudaMalloc(&simulated_->window, spec_.window_bytes));
    local_ = simulated_->window;
    allocated_ = spec_.window_bytes;
    FLEXEP_CUDA_CHECK(cudaMemset(local_, 0, spec_.window_bytes));
    if (spec_.flag_bytes) {
      FLEXEP_CUDA_CHECK(cudaMalloc(&simulated_->flags, spec_.flag_bytes));
      FLEXEP_CUDA_CHECK(cudaMemset(simulated_->flags, 0, spec_.flag_bytes));
    }
    FLEXEP_CUDA_CHECK(cudaDeviceSynchronize());
    // Every rank publishes where its holder lives; the holders stay put until the barrier below.
    const std::vector<long long> all = comm_->all_gather_i64(
        {static_cast<long long>(reinterpret_cast<std::uintptr_t>(&simulated_))}, name_ + ":simulated-peers");
    for (int r = 0; r < comm_->size(); ++r) {
      const auto* holder =
          reinterpret_cast<const std::shared_ptr<SimulatedMemory>*>(static_cast<std::uintptr_t>(all[r]));
      simulated_peers_.push_back(*holder);
      peer_windows_.push_back(static_cast<char*>(simulated_peers_.back()->window));
      peer_flags_.push_back(static_cast<char*>(simulated_peers_.back()->flags));
    }
    publish_peers();
    comm_->barrier(name_ + ":init");  // every rank zeroed its buffers and took its peers' holders
  } catch (...) {
    teardown_local();
    throw;
  }
}

void SymmetricBuffer::publish_peers() {
  const int R = size();
  for (int r = 0; r < R && r < kMaxSymmetricPeers; ++r) {
    peers_.window[r] = peer_windows_[static_cast<std::size_t>(r)];
    peers_.flags[r] = peer_flags_[static_cast<std::size_t>(r)];
  }
  std::vector<char*> table(peer_windows_);
  table.insert(table.end(), peer_flags_.begin(), peer_flags_.end());
  FLEXEP_CUDA_CHECK(cudaMalloc(&peer_table_, table.size() * sizeof(char*)));
  FLEXEP_CUDA_CHECK(cudaMemcpy(peer_table_, table.data(), table.size() * sizeof(char*), cudaMemcpyHostToDevice));
}

const SymmetricPeers& SymmetricBuffer::peers() const {
  FLEXEP_CHECK(size() <= kMaxSymmetricPeers, name_, ": the by-value peer table holds ", kMaxSymmetricPeers,
               " ranks, the group has ", size(), " (use peer_table())");
  return peers_;
}

void SymmetricBuffer::resize(const SymmetricBufferSpec& spec) {
  free();
  init(spec);
}

void SymmetricBuffer::free() {
  if (!initialized() && !dev_comm_created_) return;
  {
    cuda::DeviceGuard guard(comm_->device());
    FLEXEP_CUDA_CHECK(cudaDeviceSynchronize());  // our kernels on this GPU are done
  }
  if (!comm_->aborted()) comm_->barrier(name_ + ":free");  // ... and on every GPU
  teardown_local();
}

void SymmetricBuffer::teardown_local() noexcept {
  if (!local_ && !dev_comm_created_ && !simulated_) return;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(comm_->device());
  // No kernel using the devComm or the window may still run (NCCL 2.28.9 teardown order:
  // devComm, then window, then memory).
  cudaDeviceSynchronize();
  const bool usable = !comm_->aborted();
  if (dev_comm_created_ && usable) {
    ncclDevCommDestroy(comm_->get(), &dev_comm_);
    settle(comm_->get(), comm_->timeout_seconds());
  }
  if (window_ && usable) {
    ncclCommWindowDeregister(comm_->get(), window_);
    settle(comm_->get(), comm_->timeout_seconds());
  }
  if (peer_table_) cudaFree(peer_table_);
  if (comm_->simulated()) {
    simulated_.reset();  // freed with the last rank's reference
    simulated_peers_.clear();
  } else if (local_) {
    ncclMemFree(local_);
  }
  cudaSetDevice(previous);
  local_ = nullptr;
  window_ = nullptr;
  allocated_ = 0;
  dev_comm_ = {};
  dev_comm_created_ = false;
  flag_handle_ = 0;
  peers_ = {};
  peer_windows_.clear();
  peer_flags_.clear();
  peer_table_ = nullptr;
}

}  // namespace flexep
