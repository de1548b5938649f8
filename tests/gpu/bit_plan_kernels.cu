// bit_plan_kernels.h: the internal launcher of the hybridep bit plan, reached from a test.
#include "dispatch/hybridep/kernels.h"
#include "gpu/bit_plan_kernels.h"

namespace flexep::testing {

bool bit_plan_takes(std::int64_t tokens, int experts) { return hybridep::bit_plan_fits(tokens, experts); }

void run_bit_plan(const void* indices, bool indices_i64, std::int64_t tokens, int k, int experts, std::int64_t* counts,
                  std::int64_t* begin, std::int32_t* slot_rows, cuda::DeviceErrorRecord* errors, cudaStream_t stream) {
  hybridep::prepare_bit_plan();
  hybridep::launch_bit_plan(indices, indices_i64, tokens, k, experts, reinterpret_cast<long long*>(counts),
                            reinterpret_cast<long long*>(begin), slot_rows, errors, stream);
}

}  // namespace flexep::testing
