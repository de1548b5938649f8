#include "flexep/cuda/runtime.h"

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace flexep::cuda {

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  throw_error("CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") in ", expr, " at ", file, ":",
              line);
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

namespace {
thread_local cudaStream_t t_stream = nullptr;

// Each allocation is freed on the stream it was allocated on, whichever stream is current when it is
// freed: a tensor that Python drops outside any flexep call would otherwise be freed on the legacy
// stream, which is not ordered after a non-blocking stream's kernels (torch's side streams), and the
// pool could hand the memory to another stream while those kernels still use it. A stream destroyed
// before its allocations are freed is retired first (retire_stream): its work is waited for and its
// allocations are freed on the legacy stream from then on, since freeing on a destroyed stream is
// undefined (the first run of the map without retirement crashed in the MoE layer's test, whose
// layer destroys its side stream before its members' tensors). Memory made on one stream and last
// read on another, which has joined the first, is moved to the reader's stream (free_on).
class PoolAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes, Device device) override {
    DeviceGuard guard(device.index);
    void* p = nullptr;
    FLEXEP_CUDA_CHECK(cudaMallocAsync(&p, bytes, t_stream));
    if (p != nullptr) {
      const std::lock_guard<std::mutex> lock(mutex_);
      live_[static_cast<char*>(p)] = {t_stream, bytes};
    }
    return p;
  }
  void deallocate(void* p, Device device) noexcept override {
    cudaStream_t stream = t_stream;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto it = live_.find(static_cast<char*>(p));
      if (it != live_.end()) stream = it->second.stream, live_.erase(it);
    }
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device.index);
    cudaFreeAsync(p, stream);
    cudaSetDevice(previous);
  }
  void memset_zero(void* p, std::size_t bytes, Device device) override {
    DeviceGuard guard(device.index);
    FLEXEP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, t_stream));
  }
  // After `s` has completed its work: its live allocations are freed on the legacy stream.
  void retire(cudaStream_t s) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [p, a] : live_)
      if (a.stream == s) a.stream = nullptr;
  }
  // The allocation holding address p (any byte of it) is freed on s from now on.
  void free_on(const void* p, cudaStream_t s) {
    const std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.upper_bound(static_cast<char*>(const_cast<void*>(p)));
    if (it == live_.begin()) return;
    --it;
    if (static_cast<const char*>(p) < it->first + it->second.bytes) it->second.stream = s;
  }

 private:
  struct Live {
    cudaStream_t stream;  // where it is freed: the stream it was made on, unless free_on moved it
    std::size_t bytes;
  };
  std::mutex mutex_;
  std::map<char*, Live> live_;  // by address, so that a view's address finds its allocation
};

// Keep freed memory in the pool instead of returning it to the driver at each sync: training and
// benchmark loops allocate the same sizes every step.
PoolAllocator& pool_allocator() {
  static PoolAllocator allocator;
  return allocator;
}

void keep_pool_memory(int device) {
  cudaMemPool_t pool;
  FLEXEP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  std::uint64_t threshold = UINT64_MAX;
  FLEXEP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
}
}  // namespace

void init() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int d = 0; d < device_count(); ++d) keep_pool_memory(d);
    register_allocator(DeviceKind::cuda, &pool_allocator());
  });
}

cudaStream_t current_stream() { return t_stream; }

void retire_stream(cudaStream_t s) {
  if (s == nullptr) return;  // the legacy stream is never destroyed
  cudaStreamSynchronize(s);
  pool_allocator().retire(s);
}

void destroy_stream(cudaStream_t s) {
  retire_stream(s);
  cudaStreamDestroy(s);
}

void free_on(const TensorView& t, cudaStream_t s) {
  if (t.data != nullptr && t.device.is_cuda()) pool_allocator().free_on(t.data, s);
}

StreamGuard::StreamGuard(cudaStream_t s) : previous_(t_stream) { t_stream = s; }
StreamGuard::~StreamGuard() { t_stream = previous_; }

DeviceGuard::DeviceGuard(int device) {
  FLEXEP_CUDA_CHECK(cudaGetDevice(&previous_));
  if (device != previous_) FLEXEP_CUDA_CHECK(cudaSetDevice(device));
}
DeviceGuard::~DeviceGuard() { cudaSetDevice(previous_); }

namespace {
// A copy from or to pageable host memory is staged by the driver, which may hold the calling
// thread inside the driver until the stream's earlier work is done. With simulated ranks in one
// process, that earlier work can be a kernel waiting for a peer whose own thread must launch into
// the same driver first: the ranks then wait on each other. Waiting for the stream here, outside
// the copy, lets the peer's launch through.
void wait_before_pageable_copy(cudaStream_t stream) { FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream)); }
}  // namespace

Tensor to_device(const TensorView& host, int device, cudaStream_t stream) {
  FLEXEP_CHECK(host.device.is_cpu(), "to_device: the source must be a CPU tensor");
  init();
  StreamGuard sg(stream);
  Tensor t = Tensor::empty(host.shape, host.dtype, Device::cuda(device));
  wait_before_pageable_copy(stream);
  if (host.nbytes()) FLEXEP_CUDA_CHECK(cudaMemcpyAsync(t.raw(), host.data, host.nbytes(), cudaMemcpyHostToDevice, stream));
  // The source is pageable host memory the caller may free right after: finish the copy.
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  return t;
}

Tensor to_host(const TensorView& d, cudaStream_t stream) {
  FLEXEP_CHECK(d.device.is_cuda(), "to_host: the source must be a CUDA tensor");
  Tensor t = Tensor::empty(d.shape, d.dtype);
  wait_before_pageable_copy(stream);
  if (d.nbytes()) FLEXEP_CUDA_CHECK(cudaMemcpyAsync(t.raw(), d.data, d.nbytes(), cudaMemcpyDeviceToHost, stream));
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  return t;
}

void copy_async(const TensorView& dst, const TensorView& src, cudaStream_t stream) {
  FLEXEP_CHECK(dst.nbytes() == src.nbytes(), "copy_async: ", dst.nbytes(), " != ", src.nbytes(), " bytes");
  if (src.nbytes()) FLEXEP_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDefault, stream));
}

void zero_async(const TensorView& t, cudaStream_t stream) {
  if (t.nbytes()) FLEXEP_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), stream));
}

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(s, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone;
}

void require_device_memory(std::size_t bytes, std::size_t reusable, int device, const std::string& arg,
                           const std::string& what) {
  DeviceGuard guard(device);
  std::size_t free_bytes = 0, total_bytes = 0;
  FLEXEP_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const double gib = 1024.0 * 1024.0 * 1024.0;
  FLEXEP_CHECK_ARG(bytes <= free_bytes + reusable, arg, what, " need ", static_cast<double>(bytes) / gib,
                   " GiB of device memory, more than the ", static_cast<double>(free_bytes + reusable) / gib,
                   " GiB free on GPU ", device, " (of ", static_cast<double>(total_bytes) / gib, " GiB)");
}

int sm_count(int device) {
  static std::mutex m;
  static std::vector<int> cache;
  std::lock_guard<std::mutex> lock(m);
  if (cache.empty()) cache.assign(static_cast<std::size_t>(std::max(device_count(), 1)), 0);
  FLEXEP_CHECK(device >= 0 && device < static_cast<int>(cache.size()), "sm_count: no device ", device);
  int& n = cache[static_cast<std::size_t>(device)];
  if (!n) FLEXEP_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

namespace {
cudaMemPool_t default_pool(int device) {
  cudaMemPool_t pool = nullptr;
  FLEXEP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  return pool;
}

std::uint64_t pool_attribute(int device, cudaMemPoolAttr attr) {
  std::uint64_t value = 0;
  FLEXEP_CUDA_CHECK(cudaMemPoolGetAttribute(default_pool(device), attr, &value));
  return value;
}
}  // namespace

std::uint64_t pool_peak_bytes(int device) { return pool_attribute(device, cudaMemPoolAttrUsedMemHigh); }

std::uint64_t pool_used_bytes(int device) { return pool_attribute(device, cudaMemPoolAttrUsedMemCurrent); }

void reset_pool_peak_bytes(int device) {
  std::uint64_t zero = 0;  // resets the high-water mark to the current use
  FLEXEP_CUDA_CHECK(cudaMemPoolSetAttribute(default_pool(device), cudaMemPoolAttrUsedMemHigh, &zero));
}

}  // namespace flexep::cuda
