// Errors found inside kernels. Validating user data (expert ids, counts) on the host would cost a
// copy and a sync, so kernels check as they read and record the first violation in a small device
// record; the host reads it at its next sync and raises an ArgumentError naming the argument, the
// position and the value. Kernels never index memory with an unchecked user value.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace flexep::cuda {

enum class DeviceArg : int {
  none = 0,
  indices = 1,          // top-k expert ids outside [-1, E) or repeated within a token
  routing_map = 2,      // multihot rows with more than the supported experts per token
  tokens_per_expert = 3,
  budget_rows = 4,      // budget overflow (policy error)
  row_ids = 5,          // a gathered GEMM's row id outside [-1, rows of a)
  group_offsets = 6,    // a grouped GEMM's group offsets decreasing or outside [0, rows]
};

struct DeviceErrorRecord {
  int arg;             // DeviceArg, 0 = no error
  int column;          // slot j, or -1
  long long row;       // token / row index
  long long value;     // the offending value
  long long limit;     // the bound it broke
};

#ifdef __CUDACC__
// First error wins; later ones are dropped (the host reports one precise error).
__device__ inline void report_device_error(DeviceErrorRecord* rec, DeviceArg arg, long long row, int column,
                                           long long value, long long limit) {
  if (atomicCAS(&rec->arg, 0, -1) == 0) {
    rec->row = row;
    rec->column = column;
    rec->value = value;
    rec->limit = limit;
    __threadfence();
    atomicExch(&rec->arg, static_cast<int>(arg));
  }
}
#endif

// Owns one record on a device.
class DeviceErrors {
 public:
  explicit DeviceErrors(int device);
  ~DeviceErrors();
  DeviceErrors(const DeviceErrors&) = delete;
  DeviceErrors& operator=(const DeviceErrors&) = delete;
  DeviceErrorRecord* record() const { return rec_; }
  int device() const { return device_; }
  // Copies the record back (synchronising `stream`), clears it, and throws ArgumentError when a
  // kernel reported a violation. `context` prefixes the message ("dispatch").
  void check(cudaStream_t stream, const std::string& context);

 private:
  int device_;
  DeviceErrorRecord* rec_ = nullptr;
};

}  // namespace flexep::cuda
