// The call signature of a dispatch: the header every rank sends to every rank in the count
// exchange, before any data moves (the GPU backends as words, the host backend as the struct). It
// carries
//   - the result of this rank's local checks (failed, and the argument its ArgumentError named),
//   - a device-side argument violation found by this rank's kernels (device_*),
//   - the configuration every rank must agree on, and this rank's token count;
// and the rules applied to the gathered signatures, identical on every rank so that all ranks
// raise the same error together. Each backend keeps its own wrapper (encode/decode to its word
// type, the order of its checks, its device-violation messages).
//
// Pure C++ without CUDA headers: built in CPU-only builds and exercised by the CPU tests.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "flexep/core/error.h"
#include "flexep/core/plan.h"
#include "flexep/dispatch/dispatcher.h"
#include "dispatch/common/signature_words.h"

namespace flexep::call_signature {

struct CallSignature {
  bool failed = false;   // host-side checks failed
  std::string argument;  // their ArgumentError's argument ("" for other errors)
  int device_arg = 0;    // cuda::DeviceArg of a device-side violation (1 indices, 2 routing_map, ...)
  std::int64_t device_row = 0, device_column = -1, device_value = 0, device_limit = 0;
  int experts = 0;
  bool multihot = false;
  std::int64_t hidden = 0;
  std::int64_t topk = 0;
  DispatchMode mode = DispatchMode::blocking;
  std::int64_t pad_multiple = 1;
  std::int64_t budget_rows = 0;
  OverflowPolicy overflow = OverflowPolicy::error;
  std::int64_t tokens = 0;
  // Rows travel as e4m3 with fp32 scales (hybridep's dispatch_fp8). Not among the shared words:
  // hybridep appends it; the alltoall backend has no FP8 dispatch and leaves it false.
  bool fp8 = false;
  // The dtypes of hidden and of the routing weights. Not among the shared words: the GPU backends
  // accept one dtype of each (bf16 rows, f32 weights), so only the host backend, which takes
  // several, sets them.
  DType hidden_dtype = DType::f32;
  DType weight_dtype = DType::f32;
  // Not among the shared words either: a backend that writes one layout refuses the other
  // locally (check::expert_major_layout); the host backend, which writes both, compares it.
  DispatchLayout layout = DispatchLayout::expert_major;
};

// Writes the kWords shared words of `s` to `w` (64-bit words: std::int64_t or long long).
template <class Word>
void encode_words(const CallSignature& s, Word* w) {
  static_assert(sizeof(Word) == 8, "the signature travels as 64-bit words");
  w[word::status] = s.failed ? 1 : 0;
  char name[8 * word::argument_words] = {};
  std::memcpy(name, s.argument.data(), std::min(s.argument.size(), sizeof name));
  std::memcpy(&w[word::argument], name, sizeof name);
  w[word::device_arg] = s.device_arg;
  w[word::device_row] = s.device_row;
  w[word::device_column] = s.device_column;
  w[word::device_value] = s.device_value;
  w[word::device_limit] = s.device_limit;
  w[word::experts] = s.experts;
  w[word::multihot] = s.multihot ? 1 : 0;
  w[word::hidden] = s.hidden;
  w[word::topk] = s.topk;
  w[word::mode] = s.mode == DispatchMode::budget ? 1 : 0;
  w[word::pad_multiple] = s.pad_multiple;
  w[word::budget_rows] = s.budget_rows;
  w[word::overflow] = s.overflow == OverflowPolicy::drop ? 1 : 0;
  w[word::tokens] = s.tokens;
}

// Reads the kWords shared words (fp8 stays false).
template <class Word>
CallSignature decode_words(const Word* w) {
  static_assert(sizeof(Word) == 8, "the signature travels as 64-bit words");
  CallSignature s;
  s.failed = w[word::status] != 0;
  char name[8 * word::argument_words + 1] = {};
  std::memcpy(name, &w[word::argument], 8 * word::argument_words);
  s.argument = name;  // stops at the first NUL
  s.device_arg = static_cast<int>(w[word::device_arg]);
  s.device_row = w[word::device_row];
  s.device_column = w[word::device_column];
  s.device_value = w[word::device_value];
  s.device_limit = w[word::device_limit];
  s.experts = static_cast<int>(w[word::experts]);
  s.multihot = w[word::multihot] != 0;
  s.hidden = w[word::hidden];
  s.topk = w[word::topk];
  s.mode = w[word::mode] ? DispatchMode::budget : DispatchMode::blocking;
  s.pad_multiple = w[word::pad_multiple];
  s.budget_rows = w[word::budget_rows];
  s.overflow = w[word::overflow] ? OverflowPolicy::drop : OverflowPolicy::error;
  s.tokens = w[word::tokens];
  return s;
}

// Runs this rank's local checks. An Error they raise (ArgumentError included) is returned, not
// raised: the rank still takes part in the count exchange, with a signature that says it failed
// (naming the ArgumentError's argument), so that every rank stops together. Other exceptions
// propagate.
template <class Checks>
std::exception_ptr run_local_checks(CallSignature& mine, Checks&& checks) {
  try {
    checks();
  } catch (const ArgumentError& e) {
    mine.failed = true;
    mine.argument = e.argument();
    return std::current_exception();
  } catch (const Error&) {
    mine.failed = true;
    return std::current_exception();
  }
  return nullptr;
}

// Fills the configuration words of this rank's signature: E, the routing form, H, k (0 in the
// multihot form), the options that shape the layout, and T.
void set_call(CallSignature& s, int experts, bool multihot, std::int64_t hidden, std::int64_t topk,
              const DispatchOptions& options, std::int64_t tokens);

// The layout parameters of a call with these options (the caller validates them).
PlanParams plan_params(const DispatchOptions& options, int ranks, int experts);

// Null when every rank agrees with rank 0 on the configuration (T may differ); otherwise an
// ArgumentError naming the first field that differs, the first rank that differs and both values.
// Fields are checked in the order a user would fix them.
std::exception_ptr compare_headers(const std::vector<CallSignature>& headers);

// A device-side violation as a backend reports it: the argument to name and the message.
struct DeviceViolation {
  std::string argument;
  std::string message;
};
using DescribeViolation = DeviceViolation (*)(const CallSignature&);

// The message of a bad expert id (cuda::DeviceArg indices): out of range, or listed twice in a token.
std::string index_violation(const CallSignature& s);

// The error of the first rank other than `me` whose signature says it failed (its host-side checks,
// or a device-side violation described by `describe`), quoted so that every rank raises an error
// of the same kind naming the same argument; null when none. (A failing rank raises its own, more
// precise error itself.)
std::exception_ptr peer_failure(const std::vector<CallSignature>& headers, int me, DescribeViolation describe);

}  // namespace flexep::call_signature
