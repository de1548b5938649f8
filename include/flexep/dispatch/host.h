// The `host` backend: R simulated ranks on the CPU (threads of one process), the default where no
// GPU exists and the oracle of every other backend. It runs the plan of core/plan.h literally:
// counts are all-gathered, every rank builds the same DispatchPlan, senders compute slot rows and
// receivers copy rows from the senders' published inputs. tokens_per_expert is on the host in both
// modes (there is no device to keep it on). A bad argument on one rank fails the call on every rank.
#pragma once

#include <memory>

#include "flexep/comm/host_world.h"
#include "flexep/dispatch/dispatcher.h"

namespace flexep {

std::unique_ptr<TokenDispatcher> make_host_dispatcher(std::shared_ptr<HostWorld> world, int rank,
                                                      int num_experts);

}  // namespace flexep
