#include "flexep/dispatch/dispatcher.h"

#include "flexep/core/checks.h"

namespace flexep {

std::unique_ptr<TokenDispatcher> TokenDispatcher::make_sibling(std::int64_t) const {
  throw_argument_error("backend.dispatch_chunks", "needs a dispatcher per chunk, and the '", backend(),
                       "' dispatcher cannot make more of itself; allowed with it: 1");
}

std::vector<std::shared_ptr<TokenDispatcher>> make_chunk_dispatchers(std::shared_ptr<TokenDispatcher> first,
                                                                     int chunks) {
  const std::int64_t chunk_tokens = (first->max_tokens_per_rank() + chunks - 1) / chunks;
  std::vector<std::shared_ptr<TokenDispatcher>> all{first};
  for (int c = 1; c < chunks; ++c) all.push_back(first->make_sibling(chunk_tokens));
  return all;
}

void TokenDispatcher::check_handle(const Handle& handle) const {
  FLEXEP_CHECK_ARG(handle != nullptr, "handle", "is empty; pass the handle returned by this dispatcher's dispatch");
  FLEXEP_CHECK_ARG(handle->owner == this, "handle", "was made by another dispatcher (backend '", handle->backend,
                   "', rank ", handle->rank, "), not by this '", backend(), "' dispatcher of rank ", rank(),
                   "; pass the handle returned by this dispatcher's dispatch");
}

void TokenDispatcher::check_handle_tensor(const TensorView& t, std::int64_t rows, std::int64_t cols, DType dtype,
                                          const std::string& arg) {
  check::defined(t, arg);
  const bool two_d = cols >= 0;
  const bool ok =
      two_d ? (t.dim() == 2 && t.size(0) == rows && t.size(1) == cols) : (t.dim() == 1 && t.size(0) == rows);
  if (!ok) {
    if (two_d)
      throw_argument_error(arg, "expected shape [*, ", cols, "] with ", rows, " rows from the handle, got ",
                           t.shape.str());
    throw_argument_error(arg, "expected shape [", rows, "] (the rows of the handle), got ", t.shape.str());
  }
  FLEXEP_CHECK_ARG(t.dtype == dtype, arg, "expected dtype ", dtype_name(dtype), " as recorded in the handle, got ",
                   dtype_name(t.dtype));
}

}  // namespace flexep
