#include "dispatch/host/dispatcher/rank_failure.h"

#include "flexep/core/error.h"

namespace flexep::host {

void RankFailure::capture(std::exception_ptr e) {
  error = e;
  try {
    std::rethrow_exception(e);
  } catch (const ArgumentError& a) {
    argument = a.argument();
    message = a.what();
  } catch (const std::exception& x) {
    message = x.what();
  } catch (...) {
    message = "unknown exception";
  }
}

std::exception_ptr first_failure(const std::vector<const RankFailure*>& all, int rank) {
  if (all[static_cast<std::size_t>(rank)]->failed()) return all[static_cast<std::size_t>(rank)]->error;
  for (std::size_t r = 0; r < all.size(); ++r) {
    const RankFailure& f = *all[r];
    if (!f.failed()) continue;
    const std::string who =
        "rank " + std::to_string(r) + " failed its checks, so this collective call stops on every rank: ";
    if (f.argument.empty()) return std::make_exception_ptr(Error("flexep: " + who + f.message));
    // Quote the detail without repeating the "invalid argument" prefix the new error adds again.
    const std::string prefix = "flexep: invalid argument '" + f.argument + "': ";
    const std::string detail = f.message.rfind(prefix, 0) == 0 ? f.message.substr(prefix.size()) : f.message;
    return std::make_exception_ptr(ArgumentError(f.argument, who + detail));
  }
  return nullptr;
}

}  // namespace flexep::host
