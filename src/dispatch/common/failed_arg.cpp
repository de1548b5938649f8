#include "dispatch/common/failed_arg.h"

#include "flexep/core/error.h"

namespace flexep {

const char* failed_arg_name(FailedArg a) {
  switch (a) {
    case FailedArg::handle: return "handle";
    case FailedArg::expert_out: return "expert_out";
    case FailedArg::grad_tokens: return "grad_tokens";
    case FailedArg::grad_token_probs: return "grad_token_probs";
    case FailedArg::grad_out: return "grad_out";
    case FailedArg::out: return "out";
    default: return "";
  }
}

FailedArg failed_arg_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const ArgumentError& a) {
    for (FailedArg f : {FailedArg::handle, FailedArg::expert_out, FailedArg::grad_tokens, FailedArg::grad_token_probs,
                        FailedArg::grad_out, FailedArg::out})
      if (a.argument() == failed_arg_name(f)) return f;
  } catch (...) {
  }
  return FailedArg::other;
}

void raise_peer_failure(int peer, const std::string& phase, FailedArg arg, int me, const std::string& op) {
  const std::string who = detail::concat("rank ", peer, " failed its checks in ", phase,
                                         ", so this collective call stops on every rank: see the error raised on rank ",
                                         peer, " (found by ", op, " on rank ", me, ")");
  const char* name = failed_arg_name(arg);
  if (*name != '\0') throw ArgumentError(name, who);
  throw Error("flexep: " + who);
}

}  // namespace flexep
