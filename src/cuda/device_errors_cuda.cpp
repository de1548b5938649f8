#include "flexep/cuda/device_errors.h"

#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"

namespace flexep::cuda {

namespace {
const char* arg_name(int arg) {
  switch (static_cast<DeviceArg>(arg)) {
    case DeviceArg::indices: return "indices";
    case DeviceArg::routing_map: return "routing_map";
    case DeviceArg::tokens_per_expert: return "tokens_per_expert";
    case DeviceArg::budget_rows: return "budget_rows";
    case DeviceArg::row_ids: return "row_ids";
    case DeviceArg::group_offsets: return "offsets";
    case DeviceArg::none: break;
  }
  return "unknown";
}
}  // namespace

DeviceErrors::DeviceErrors(int device) : device_(device) {
  DeviceGuard g(device);
  FLEXEP_CUDA_CHECK(cudaMalloc(&rec_, sizeof(DeviceErrorRecord)));
  FLEXEP_CUDA_CHECK(cudaMemset(rec_, 0, sizeof(DeviceErrorRecord)));
}

DeviceErrors::~DeviceErrors() {
  if (rec_) cudaFree(rec_);
}

void DeviceErrors::check(cudaStream_t stream, const std::string& context) {
  DeviceErrorRecord h{};
  // The stream first, then the copy into pageable memory: a pageable copy may hold this thread
  // inside the driver while the stream waits for a peer rank's launch (runtime_cuda.cpp, to_host).
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  FLEXEP_CUDA_CHECK(cudaMemcpyAsync(&h, rec_, sizeof(h), cudaMemcpyDeviceToHost, stream));
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (h.arg == 0) return;
  FLEXEP_CUDA_CHECK(cudaMemsetAsync(rec_, 0, sizeof(DeviceErrorRecord), stream));
  const std::string where =
      h.column >= 0 ? detail::concat("[", h.row, ", ", h.column, "]") : detail::concat("row ", h.row);
  switch (static_cast<DeviceArg>(h.arg)) {
    case DeviceArg::indices:
      if (h.value >= -1 && h.value < h.limit)
        throw_argument_error("indices", context, ": token ", h.row, " lists expert ", h.value,
                             " twice; each expert may appear once per token");
      throw_argument_error("indices", context, ": value ", h.value, " at ", where,
                           " is out of range; allowed: -1 (no expert) <= id < ", h.limit);
    case DeviceArg::budget_rows:
      throw_argument_error("budget_rows", context, ": overflow: ", h.value, " expert-major rows are needed but budget_rows is ",
                           h.limit, "; raise budget_rows (or the capacity factor) or use the drop overflow policy");
    case DeviceArg::row_ids:
      throw_argument_error("row_ids", context, ": value ", h.value, " at row ", h.row,
                           " is out of range; allowed: -1 (a zero row) <= id < ", h.limit, " (the rows of a)");
    case DeviceArg::group_offsets:
      throw_argument_error("offsets", context, ": offsets[", h.row, "] = ", h.value,
                           " is out of range; the offsets must not decrease and must lie in [0, ", h.limit, "]");
    default:
      throw_argument_error(arg_name(h.arg), context, ": value ", h.value, " at ", where,
                           " is out of range; limit ", h.limit);
  }
}

}  // namespace flexep::cuda
