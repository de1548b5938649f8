#include "flexep/comm/communicator.h"

#include <cuda.h>  // CUmoduleLoadingMode (the driver entry point is looked up at run time)
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <thread>

#include "flexep/comm/host_world.h"
#include "flexep/core/backoff.h"
#include "flexep/core/tensor.h"
#include "flexep/cuda/runtime.h"

namespace flexep {

using Clock = std::chrono::steady_clock;

void throw_nccl_error(ncclResult_t r, const char* expr, const char* file, int line) {
  throw_error("NCCL error ", ncclGetErrorString(r), " in ", expr, " at ", file, ":", line);
}

namespace {
Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

std::string version_string(int v) {
  // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z for 2.9+.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

ncclDataType_t nccl_type(DType t, const std::string& what) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::i64: return ncclInt64;
    case DType::i32: return ncclInt32;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    default: throw_argument_error(what, "dtype ", dtype_name(t), " cannot be reduced; allowed: f32, f64, i32, i64, bf16, f16");
  }
}

std::uint64_t host_hash() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  std::uint64_t h = 1469598103934665603ull;
  for (const char* p = name; *p; ++p) h = (h ^ static_cast<unsigned char>(*p)) * 1099511628211ull;
  return h;
}

const char* env(const char* a, const char* b = nullptr) {
  const char* v = std::getenv(a);
  if ((!v || !*v) && b) v = std::getenv(b);
  return v && *v ? v : nullptr;
}

// Polls until NCCL has no call in progress on `comm` (non-blocking mode), or the deadline passes.
ncclResult_t poll_in_progress(ncclComm_t comm, Clock::time_point deadline) {
  ncclResult_t state = ncclInProgress;
  while (true) {
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (Clock::now() > deadline) return ncclInProgress;
    std::this_thread::yield();
  }
}
}  // namespace

void check_nccl_version() {
  int runtime = 0;
  FLEXEP_NCCL_CHECK(ncclGetVersion(&runtime));
  if (runtime != NCCL_VERSION_CODE)
    throw_error("the NCCL library loaded at run time is ", version_string(runtime),
                " but flexep was built against NCCL ", version_string(NCCL_VERSION_CODE),
                " headers; NCCL's device API structures are not versioned, so they must match. Rebuild with "
                "-DFLEXEP_NCCL_ROOT pointing at the NCCL you run with (for PyTorch: the nvidia-nccl wheel), or "
                "put that library first on LD_LIBRARY_PATH");
}

void ensure_no_multicast() {
  const char* v = std::getenv("NCCL_NVLS_ENABLE");
  if (!v) {
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    return;
  }
  if (std::string(v) != "0")
    throw_error("NCCL_NVLS_ENABLE=", v, ": flexep refuses to run with NVLink multicast (NVLS) enabled; set "
                "NCCL_NVLS_ENABLE=0 before any NCCL communicator is created");
}

std::string unique_id_to_hex(const ncclUniqueId& id) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (std::size_t i = 0; i < sizeof(id.internal); ++i) {
    const auto b = static_cast<unsigned char>(id.internal[i]);
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

ncclUniqueId unique_id_from_hex(const std::string& hex) {
  ncclUniqueId id{};
  FLEXEP_CHECK_ARG(hex.size() == 2 * sizeof(id.internal), "FLEXEP_NCCL_ID", "must be ", 2 * sizeof(id.internal),
                   " hex digits, got ", hex.size());
  auto nib = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    throw_argument_error("FLEXEP_NCCL_ID", "contains '", c, "', which is not a hex digit");
  };
  for (std::size_t i = 0; i < sizeof(id.internal); ++i)
    id.internal[i] = static_cast<char>(nib(hex[2 * i]) * 16 + nib(hex[2 * i + 1]));
  return id;
}

ncclUniqueId Communicator::new_unique_id() {
  ensure_no_multicast();
  ncclUniqueId id;
  FLEXEP_NCCL_CHECK(ncclGetUniqueId(&id));
  return id;
}

Communicator::Communicator(ncclComm_t comm, bool owned, int device, const CommunicatorOptions& options)
    : comm_(comm), owned_(owned), device_(device), options_(options) {
  FLEXEP_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
  FLEXEP_NCCL_CHECK(ncclCommCount(comm_, &size_));
  discover_topology();
}

std::unique_ptr<Communicator> Communicator::create(const ncclUniqueId& id, int rank, int size, int device,
                                                   const CommunicatorOptions& options) {
  FLEXEP_CHECK_ARG(size >= 1, "size", "must be >= 1, got ", size);
  FLEXEP_CHECK_ARG(rank >= 0 && rank < size, "rank", rank, " is out of range [0, ", size, ")");
  FLEXEP_CHECK_ARG(device >= 0 && device < cuda::device_count(), "device", device, " is out of range [0, ",
                   cuda::device_count(), ")");
  FLEXEP_CHECK_ARG(options.timeout_seconds > 0, "timeout_seconds", "must be > 0, got ", options.timeout_seconds);
  check_nccl_version();
  ensure_no_multicast();
  cuda::init();
  cuda::DeviceGuard guard(device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that every wait can carry a deadline
  ncclComm_t comm = nullptr;
  FLEXEP_NCCL_CHECK(ncclCommInitRankConfig(&comm, size, id, rank, &config));
  const auto deadline = deadline_after(options.timeout_seconds);
  const ncclResult_t state = poll_in_progress(comm, deadline);
  if (state != ncclSuccess) {
    ncclCommAbort(comm);
    if (state == ncclInProgress)
      throw TimeoutError("communicator-init", -1,
                         detail::concat("rank ", rank, " of ", size, " waited ", options.timeout_seconds,
                                        " s for the other ranks to join (same unique id on every rank?)"));
    throw_nccl_error(state, "ncclCommInitRankConfig", __FILE__, __LINE__);
  }
  return std::unique_ptr<Communicator>(new Communicator(comm, true, device, options));
}

std::unique_ptr<Communicator> Communicator::from_environment(const CommunicatorOptions& options) {
  const char* r = env("OMPI_COMM_WORLD_RANK", "FLEXEP_RANK");
  const char* n = env("OMPI_COMM_WORLD_SIZE", "FLEXEP_WORLD_SIZE");
  FLEXEP_CHECK_ARG(r && n, "environment",
                   "no rank/size found: launch with mpirun, or set FLEXEP_RANK and FLEXEP_WORLD_SIZE");
  const int rank = std::atoi(r), size = std::atoi(n);
  const char* lr = env("OMPI_COMM_WORLD_LOCAL_RANK", "FLEXEP_LOCAL_RANK");
  const int gpus = cuda::device_count();
  FLEXEP_CHECK(gpus > 0, "no GPU is visible to rank ", rank);
  const int device = (lr ? std::atoi(lr) : rank) % gpus;
  ncclUniqueId id{};
  if (const char* hex = env("FLEXEP_NCCL_ID")) {
    id = unique_id_from_hex(hex);
  } else {
    const char* file = env("FLEXEP_NCCL_ID_FILE");
    FLEXEP_CHECK_ARG(file != nullptr, "environment", "set FLEXEP_NCCL_ID (hex) or FLEXEP_NCCL_ID_FILE (a path all "
                     "ranks see) so the ranks can share the NCCL unique id");
    if (rank == 0) {
      id = new_unique_id();
      const std::string tmp = std::string(file) + ".tmp" + std::to_string(getpid());
      { std::ofstream(tmp) << unique_id_to_hex(id); }
      FLEXEP_CHECK(std::rename(tmp.c_str(), file) == 0, "cannot write the unique id file '", file, "'");
    } else {
      const auto deadline = deadline_after(options.timeout_seconds);
      std::string hex;
      while (hex.size() != 2 * sizeof(id.internal)) {
        std::ifstream in(file);
        if (in) in >> hex;
        if (hex.size() == 2 * sizeof(id.internal)) break;
        if (Clock::now() > deadline)
          throw TimeoutError("unique-id-exchange", 0, detail::concat("no unique id appeared in '", file, "'"));
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      id = unique_id_from_hex(hex);
    }
  }
  return create(id, rank, size, device, options);
}

namespace {
// Whether the driver loads modules lazily (CUDA_MODULE_LOADING, read when CUDA initialised).
bool lazy_module_loading() {
  using GetLoadingMode = CUresult (*)(CUmoduleLoadingMode*);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  FLEXEP_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 11070, cudaEnableDefault, &found));
  FLEXEP_CHECK(found == cudaDriverEntryPointSuccess && fn, "the CUDA driver has no cuModuleGetLoadingMode");
  CUmoduleLoadingMode mode{};
  FLEXEP_CHECK(reinterpret_cast<GetLoadingMode>(fn)(&mode) == CUDA_SUCCESS, "cuModuleGetLoadingMode failed");
  return mode == CU_MODULE_LAZY_LOADING;
}
}  // namespace

std::unique_ptr<Communicator> Communicator::simulate(std::shared_ptr<HostWorld> world, int rank, int device,
                                                     const CommunicatorOptions& options) {
  FLEXEP_CHECK_ARG(world != nullptr, "world", "is null");
  FLEXEP_CHECK_ARG(rank >= 0 && rank < world->size(), "rank", rank, " is out of range [0, ", world->size(), ")");
  FLEXEP_CHECK_ARG(device >= 0 && device < cuda::device_count(), "device", device, " is out of range [0, ",
                   cuda::device_count(), ")");
  FLEXEP_CHECK_ARG(options.timeout_seconds > 0, "timeout_seconds", "must be > 0, got ", options.timeout_seconds);
  cuda::init();
  cuda::DeviceGuard guard(device);
  FLEXEP_CHECK_ARG(!lazy_module_loading(), "CUDA_MODULE_LOADING",
                   "must be EAGER (set before CUDA starts) for simulated ranks: with lazy loading, loading a rank's "
                   "kernel may wait for another rank's running kernel, which waits for it");
  // The ranks share this GPU's memory pool. By default the pool may hand a block that one rank freed
  // behind a kernel still waiting for its peers to another rank, making that rank's stream wait for
  // the kernel (an internal dependency): the peer's next kernel then waits for it, and the two wait
  // for each other until the deadline (seen once as a combine timeout under load). Blocks whose
  // free has completed are still reused.
  cudaMemPool_t pool = nullptr;
  FLEXEP_CUDA_CHECK(cudaDeviceGetMemPool(&pool, device));
  int allow = 0;
  FLEXEP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &allow));
  return std::unique_ptr<Communicator>(new Communicator(std::move(world), rank, device, options));
}

namespace {
// The hardware queues the driver gives a context (read when CUDA initialised; 8 by default).
int hardware_queues() {
  const char* text = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (text == nullptr || *text == '\0') return 8;
  char* end = nullptr;
  const long n = std::strtol(text, &end, 10);
  if (*end != '\0' || n < 1) return 8;
  return static_cast<int>(std::min(n, 32L));
}
}  // namespace

void Communicator::require_queue_per_rank(const std::string& backend) const {
  if (!simulated()) return;
  const int queues = hardware_queues();
  FLEXEP_CHECK_ARG(size_ <= queues, "comm", backend, ": ", size_, " simulated ranks share GPU ", device_,
                   " but it has ", queues,
                   " hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, set before CUDA starts: 8 by default, 32 at "
                   "most); two ranks' streams in one queue would wait for each other. Simulate at most ",
                   queues, " ranks");
}

std::unique_ptr<Communicator> Communicator::borrow(ncclComm_t comm, int device, const CommunicatorOptions& options) {
  FLEXEP_CHECK_ARG(comm != nullptr, "comm", "is null");
  check_nccl_version();
  cuda::init();
  cuda::DeviceGuard guard(device);
  return std::unique_ptr<Communicator>(new Communicator(comm, false, device, options));
}

Communicator::Communicator(std::shared_ptr<HostWorld> world, int rank, int device,
                           const CommunicatorOptions& options)
    : world_(std::move(world)), device_(device), options_(options) {
  rank_ = rank;
  size_ = world_->size();
  discover_topology();
}

ncclComm_t Communicator::get() const {
  FLEXEP_CHECK(comm_ != nullptr, "this communicator simulates ", size_,
               " ranks on one GPU and has no NCCL communicator; only the host and hybridep backends run on "
               "simulated ranks");
  return comm_;
}

int Communicator::sms_per_rank() const {
  const int sms = cuda::sm_count(device_);
  return simulated() ? std::max(1, sms / (2 * size_)) : sms;
}

Communicator::~Communicator() {
  if (!owned_ || aborted_ || !comm_) return;
  cuda::DeviceGuard guard(device_);
  // Finalize flushes outstanding work; bounded by the deadline like everything else.
  ncclCommFinalize(comm_);
  const auto deadline = deadline_after(options_.timeout_seconds);
  if (poll_in_progress(comm_, deadline) != ncclSuccess) {
    ncclCommAbort(comm_);
    return;
  }
  ncclCommDestroy(comm_);
}

void Communicator::discover_topology() {
  const std::vector<long long> hosts = all_gather_i64({static_cast<long long>(host_hash())}, "topology");
  domain_of_rank_.assign(static_cast<std::size_t>(size_), 0);
  std::map<long long, int> host_index;
  std::vector<int> seen_on_host;
  local_rank_ = 0;
  for (int r = 0; r < size_; ++r) {
    auto [it, fresh] = host_index.emplace(hosts[static_cast<std::size_t>(r)], static_cast<int>(host_index.size()));
    if (fresh) seen_on_host.push_back(0);
    const int local = seen_on_host[static_cast<std::size_t>(it->second)]++;
    if (r == rank_) local_rank_ = local;
    // Domains: one per host, or consecutive groups of ranks_per_domain inside a host.
    const int per = options_.ranks_per_domain;
    domain_of_rank_[static_cast<std::size_t>(r)] = it->second * 4096 + (per > 0 ? local / per : 0);
  }
  // Renumber domains densely in rank order.
  std::map<int, int> dense;
  for (int& d : domain_of_rank_) d = dense.emplace(d, static_cast<int>(dense.size())).first->second;
}

void Communicator::fail(const std::string& phase, const std::string& why, bool timeout) {
  if (!aborted_) {
    if (comm_) ncclCommAbort(comm_);
    aborted_ = true;
  }
  if (timeout) throw TimeoutError(phase, -1, why);
  throw_error("NCCL failure in phase '", phase, "': ", why);
}

void Communicator::wait_enqueued(const std::string& phase) {
  FLEXEP_CHECK(!aborted_, "the communicator was aborted after an earlier failure; create a new one");
  if (simulated()) return;  // no NCCL calls
  const auto deadline = deadline_after(options_.timeout_seconds);
  const ncclResult_t state = poll_in_progress(comm_, deadline);
  if (state == ncclInProgress)
    fail(phase, detail::concat("NCCL calls did not get enqueued within ", options_.timeout_seconds, " s"), true);
  if (state != ncclSuccess) fail(phase, ncclGetErrorString(state), false);
}

void Communicator::wait(cudaStream_t stream, const std::string& phase) {
  wait_enqueued(phase);
  const auto deadline = deadline_after(options_.timeout_seconds);
  const PollBackoff backoff(std::chrono::microseconds(50));
  while (true) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) cuda::throw_cuda_error(q, "cudaStreamQuery", __FILE__, __LINE__);
    ncclResult_t state = ncclSuccess;
    if (comm_) ncclCommGetAsyncError(comm_, &state);
    if (state != ncclSuccess && state != ncclInProgress) fail(phase, ncclGetErrorString(state), false);
    if (Clock::now() > deadline)
      fail(phase,
           detail::concat("rank ", rank_, " waited ", options_.timeout_seconds,
                          " s for the other ranks (one stopped participating, or called a different operation)"),
           true);
    backoff.pause();
  }
}

void Communicator::all_reduce_sum(const TensorView& t, const std::string& what) {
  if (!t.numel()) return;
  cuda::DeviceGuard guard(device_);
  const cudaStream_t stream = cuda::current_stream();
  if (simulated()) {  // through the host world, in rank order like the host backend
    HostProcessGroup group(world_, rank_);
    if (t.device.is_cpu()) return group.all_reduce_sum(t, what);
    Tensor h = cuda::to_host(t, stream);
    group.all_reduce_sum(h, what);
    cuda::copy_async(t, h, stream);
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  const ncclDataType_t type = nccl_type(t.dtype, what);
  if (t.device.is_cpu()) {
    Tensor d = cuda::to_device(t, device_, stream);
    FLEXEP_NCCL_CHECK(ncclAllReduce(d.raw(), d.raw(), static_cast<std::size_t>(t.numel()), type, ncclSum, comm_, stream));
    wait(stream, what);
    cuda::copy_async(t, d, stream);
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  FLEXEP_CHECK_ARG(t.device.index == device_, what, "tensor is on ", t.device.str(), " but the communicator's GPU is ",
                   device_);
  FLEXEP_NCCL_CHECK(ncclAllReduce(t.data, t.data, static_cast<std::size_t>(t.numel()), type, ncclSum, comm_, stream));
  wait(stream, what);
}

void Communicator::barrier(const std::string& what) {
  if (simulated()) return world_->barrier(rank_, what);
  Tensor one = Tensor::from_vector<std::int32_t>({1}, {1});
  all_reduce_sum(one, what);
}

std::vector<long long> Communicator::all_gather_i64(const std::vector<long long>& mine, const std::string& what) {
  if (simulated()) {
    const std::vector<const void*> all = world_->all_gather_ptr(rank_, &mine, what);
    std::vector<long long> out;
    bool same_count = true;
    for (const void* p : all) {
      const auto& theirs = *static_cast<const std::vector<long long>*>(p);
      same_count = same_count && theirs.size() == mine.size();
      out.insert(out.end(), theirs.begin(), theirs.end());
    }
    world_->barrier(rank_, what + ":read");  // the others' vectors stay alive until all have read
    FLEXEP_CHECK(same_count, what, ": the ranks gathered different numbers of values");
    return out;
  }
  cuda::init();
  cuda::DeviceGuard guard(device_);
  const cudaStream_t stream = cuda::current_stream();
  const auto count = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> mine64(mine.begin(), mine.end());
  Tensor send = cuda::to_device(Tensor::from_vector<std::int64_t>(mine64, {count}), device_, stream);
  Tensor recv = Tensor::empty({count * size_}, DType::i64, Device::cuda(device_));
  FLEXEP_NCCL_CHECK(ncclAllGather(send.raw(), recv.raw(), static_cast<std::size_t>(count), ncclInt64, comm_, stream));
  wait(stream, what);
  const Tensor host = cuda::to_host(recv, stream);
  return std::vector<long long>(host.data<std::int64_t>(), host.data<std::int64_t>() + host.numel());
}

}  // namespace flexep
