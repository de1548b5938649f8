// chunk_plan_kernels.h: the internal launcher of the hybridep chunk plan, reached from a test.
#include "dispatch/hybridep/kernels/chunk_plan_math.h"
#include "dispatch/hybridep/kernels/kernels.h"
#include "gpu/chunk_plan_kernels.h"

namespace flexep::testing {

bool chunk_plan_takes(int experts) { return hybridep::chunk_plan_fits(experts); }
std::int64_t chunk_plan_chunk_tokens() { return hybridep::kPlanChunkTokens; }

void run_chunk_plan(const void* indices, bool indices_i64, std::int64_t tokens, int k, int experts, int grid,
                    std::int64_t* counts, std::int32_t* chunk_base, std::int32_t* slot_rank, std::uint32_t* done,
                    cuda::DeviceErrorRecord* errors, cudaStream_t stream) {
  hybridep::prepare_chunk_plan(experts);
  hybridep::ChunkPlanCall c;
  c.indices = indices;
  c.indices_i64 = indices_i64 ? 1 : 0;
  c.tokens = tokens;
  c.slots = k;
  c.experts = experts;
  c.counts = reinterpret_cast<long long*>(counts);
  c.chunk_base = chunk_base;
  c.slot_rank = slot_rank;
  c.done = done;
  c.errors = errors;
  hybridep::launch_chunk_plan(c, grid, stream);
}

}  // namespace flexep::testing
