// HOOK FOR THE LEAD: connects the `hybridep` backend to Python. flexep.torch asks for a GPU
// dispatcher by name (make_gpu_dispatcher("hybridep", comm, E, backend_json)); this file is the one
// place that registers the hybridep factory. Until the backend's header exists, the name stays
// unregistered and Python raises "'hybridep' has no GPU dispatcher in this build".
//
// To connect it, replace the body of register_hybridep() with something like:
//   register_dispatcher_factory("hybridep", [](std::shared_ptr<ProcessGroup> pg, int E, const BackendConfig& b) {
//     auto comm = std::dynamic_pointer_cast<Communicator>(pg);
//     FLEXEP_CHECK_ARG(comm != nullptr, "comm", "the hybridep backend needs a flexep Communicator");
//     HybridEPOptions o;                       // whatever hybridep.h takes
//     o.dispatch_sms = b.dispatch_sms();       // BackendConfig's effective SM counts
//     o.combine_sms = b.combine_sms();
//     return std::shared_ptr<TokenDispatcher>(make_hybridep_dispatcher(std::move(comm), E, o));
//   });
// (inside #ifdef FLEXEP_WITH_CUDA, with #include "flexep/comm/communicator.h" and
// "flexep/dispatch/hybridep.h"). Nothing is included until then, so a backend still in progress can
// never break the extension's build.
#include "bindings.h"

namespace flexep::py {

void register_hybridep() {
  // Not connected yet (see above).
}

}  // namespace flexep::py
