// CUDA runtime glue for the library: error checking, the device allocator (stream-ordered pool,
// registered with the core so Tensor::empty works on Device::cuda), the current stream of a thread,
// and host<->device copies. Included only by code built with FLEXEP_WITH_CUDA.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "flexep/core/tensor.h"

#define FLEXEP_CUDA_CHECK(expr)                                                          \
  do {                                                                                   \
    const cudaError_t flexep_err_ = (expr);                                              \
    if (flexep_err_ != cudaSuccess) ::flexep::cuda::throw_cuda_error(flexep_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: reports launch-configuration errors at the call site.
#define FLEXEP_CUDA_CHECK_LAUNCH(name) FLEXEP_CUDA_CHECK(cudaPeekAtLastError())

namespace flexep::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);

// Number of visible GPUs; 0 when there is no driver or no device (never throws).
int device_count();
// Registers the device allocator (idempotent, thread-safe). Called by every entry point that
// creates device tensors.
void init();

// The library's device memory (the stream-ordered pool of `device`): the most it held at once since
// the last reset, in bytes (cudaMemPoolAttrUsedMemHigh), and that reset. PyTorch's allocator does not
// see this memory; a peak of the whole process is the two peaks' sum at most.
std::uint64_t pool_peak_bytes(int device);
// What the pool holds now (cudaMemPoolAttrUsedMemCurrent): after a sync, the live tensors' bytes.
std::uint64_t pool_used_bytes(int device);
void reset_pool_peak_bytes(int device);

// The stream device allocations of this thread are ordered on (default: the legacy stream 0).
// Memory is allocated with cudaMallocAsync on it and freed with cudaFreeAsync on that same stream
// (the allocation's, whichever stream is current when the tensor is released), so a tensor may be
// released as soon as the last kernel using it has been *enqueued* there. Work on other streams that
// uses the tensor must be joined back to it first.
cudaStream_t current_stream();
class StreamGuard {
 public:
  explicit StreamGuard(cudaStream_t s);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  cudaStream_t previous_;
};

// A stream that device allocations were made on must be retired before it is destroyed, unless
// every such allocation was freed first: retire_stream waits for its work and has the allocator free
// its remaining allocations on the legacy stream (freeing on a destroyed stream is undefined).
// destroy_stream retires, then destroys; every stream flexep creates goes that way (OwnedStream).
void retire_stream(cudaStream_t s);
void destroy_stream(cudaStream_t s);

// The pool allocation holding `t` is freed on `s` from now on, not on the stream it was made on: for
// memory written on a side stream and last read on `s` after `s` joined that side stream (an
// experts' output read by the caller's combine). Freed on the side stream, the memory could go to
// another stream's allocation (another rank's thread) while `s` still reads it; making the side
// stream wait for `s` instead would also leave a CUDA graph's capture unjoined. Memory that is not
// the pool's (a caller's tensor) is left alone.
void free_on(const TensorView& t, cudaStream_t s);

// An owned stream, retired and destroyed with its owner.
class OwnedStream {
 public:
  explicit OwnedStream(unsigned flags = cudaStreamDefault) {
    FLEXEP_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, flags));
  }
  ~OwnedStream() { destroy_stream(s_); }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  cudaStream_t get() const { return s_; }
  operator cudaStream_t() const { return s_; }  // NOLINT: used where a stream is taken

 private:
  cudaStream_t s_ = nullptr;
};

class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
};

Tensor to_device(const TensorView& host, int device, cudaStream_t stream);
Tensor to_host(const TensorView& device_tensor, cudaStream_t stream);  // synchronises the stream
void copy_async(const TensorView& dst, const TensorView& src, cudaStream_t stream);
void zero_async(const TensorView& t, cudaStream_t stream);

// Streaming multiprocessors of a device (cached).
int sm_count(int device);

// Whether `s` is capturing a CUDA graph (work enqueued on it is recorded, not run).
bool capturing(cudaStream_t s);

// Refuses, before anything is allocated, `bytes` of new device memory on `device` that the GPU
// does not have free (less `reusable`, bytes the caller frees first): an ArgumentError naming
// `arg`, with `what` needs and what is free, in GiB.
void require_device_memory(std::size_t bytes, std::size_t reusable, int device, const std::string& arg,
                           const std::string& what);

}  // namespace flexep::cuda
