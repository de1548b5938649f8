// When one rank's combine or backward fails its argument checks, the other ranks must raise that
// error too instead of waiting out their deadline for rows that never come. The failing rank still
// takes part in the call's flags and leaves, beside them, which argument failed: one of these codes
// (a plain int in device memory, so the kernels of every backend can carry it).
#pragma once

#include <exception>
#include <string>

namespace flexep {

enum class FailedArg : int { none = 0, handle = 1, expert_out = 2, grad_tokens = 3, grad_token_probs = 4, grad_out = 5,
                             out = 6, other = 7 };

// The argument's name as the failing rank's ArgumentError gives it; "" for none and other.
const char* failed_arg_name(FailedArg a);

// The code of the exception a rank's checks raised (other for anything but a known argument).
FailedArg failed_arg_of(const std::exception_ptr& e);

// What a peer raises when rank `peer` failed its checks in `phase`: an ArgumentError naming the
// same argument (a plain Error when the argument has no code), pointing at the failing rank.
[[noreturn]] void raise_peer_failure(int peer, const std::string& phase, FailedArg arg, int me, const std::string& op);

}  // namespace flexep
