// Argument checks of the routing form shared by the collective GPU backends (alltoall, hybridep),
// run before the count exchange; private, next to the public ones of flexep/core/checks.h. Pure C++
// without CUDA headers.
#pragma once

#include <cstdint>
#include <functional>

#include "flexep/core/tensor.h"
#include "flexep/dispatch/dispatcher.h"

namespace flexep::check {

// The routing arguments of a dispatch with `tokens` tokens, on `device`: either the multihot form
// (routing_map b8 and probs f32, both [T, experts]) or the top-k form (indices i32/i64 [T, k] and
// weights f32 [T, k]), never both. In the top-k form, `check_k` applies the backend's limits on k
// after the indices' own checks and before the weights'.
void routing_form(const DispatchInput& in, std::int64_t tokens, int experts, Device device,
                  const std::function<void(std::int64_t k)>& check_k);

// options.layout for a backend that writes the expert-major layout only.
void expert_major_layout(const DispatchOptions& options, std::string_view backend);

}  // namespace flexep::check
