// Connects the `hybridep` backend to Python: flexep.torch asks for a GPU dispatcher by name
// (make_gpu_dispatcher("hybridep", comm, E, backend_json, hidden, max_tokens_per_rank, max_topk)).
// Its buffers are sized once from these, so they are required here.
#include "bindings.h"

#ifdef FLEXEP_WITH_CUDA
#include "flexep/comm/communicator.h"
#include "flexep/dispatch/hybridep.h"
#endif

namespace flexep::py {

void register_hybridep() {
#ifdef FLEXEP_WITH_CUDA
  register_dispatcher_factory("hybridep", [](std::shared_ptr<ProcessGroup> pg, int num_experts, const BackendConfig& b,
                                             const GpuDispatcherSizes& sizes) {
    auto comm = std::dynamic_pointer_cast<Communicator>(pg);
    FLEXEP_CHECK_ARG(comm != nullptr, "comm", "the hybridep backend needs a flexep Communicator");
    FLEXEP_CHECK_ARG(sizes.hidden > 0 && sizes.max_tokens_per_rank > 0, "hidden",
                     "hybridep sizes its buffers once: pass hidden and max_tokens_per_rank (got ", sizes.hidden, ", ",
                     sizes.max_tokens_per_rank, ")");
    HybridEpOptions o = HybridEpOptions::from_backend(b, sizes.max_tokens_per_rank, sizes.hidden);
    o.max_topk = sizes.max_topk;
    // As DeepEP's buffer under Megatron / Automodel: combine and the backwards return without
    // waiting for the GPU. A device error they record is raised by the next blocking dispatch (its
    // preprocess kernel publishes the status along with the layout); one after the last dispatch
    // of a run is not raised (a peer that is gone is, by the next dispatch's count exchange).
    o.check_blocking_calls = false;
    return std::shared_ptr<TokenDispatcher>(make_hybridep_dispatcher(std::move(comm), num_experts, o));
  });
#endif
}

}  // namespace flexep::py
