// Collective failure: a rank whose local checks fail publishes the error at the next exchange
// instead of throwing alone, so every rank fails together rather than waiting for the timeout.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include "flexep/comm/host_world.h"

namespace flexep::host {

struct RankFailure {
  std::exception_ptr error;  // null: this rank's checks passed
  std::string argument;      // ArgumentError::argument(); empty for other errors
  std::string message;       // what()
  bool failed() const { return error != nullptr; }
  void capture(std::exception_ptr e);  // call inside catch (...)
};

// The error this rank must raise, or null when no rank failed: a failing rank raises its own
// error, the others one of the same kind (same argument name) quoting the first failing rank.
std::exception_ptr first_failure(const std::vector<const RankFailure*>& all, int rank);

// Publishes `mine`, copies every rank's payload and, when any rank failed its local checks or
// `agree(all)` returns an error, raises on every rank after a common barrier (a rank must not
// leave, freeing its payload, while others still read it). `agree` must be deterministic in
// `all` so that every rank takes the same branch.
template <class P, class Agree>
std::vector<P> publish(HostWorld& world, int rank, const P& mine, const std::string& phase,
                       const std::string& abort_phase, Agree agree) {
  const std::vector<const void*> ptrs = world.all_gather_ptr(rank, &mine, phase);
  std::vector<P> all;
  all.reserve(ptrs.size());
  for (const void* p : ptrs) all.push_back(*static_cast<const P*>(p));
  std::vector<const RankFailure*> status;
  for (const P& p : all) status.push_back(&p.status);
  std::exception_ptr err = first_failure(status, rank);
  if (!err) err = agree(all);
  if (err) {
    world.barrier(rank, abort_phase);
    std::rethrow_exception(err);
  }
  return all;
}

// Runs a call's body; an error it raises between collectives first waits for the peers still
// reading this rank's rows (HostWorld::leave), since unwinding frees them.
template <class Body>
auto leaving_on_error(HostWorld& world, int rank, Body body) -> decltype(body()) {
  try {
    return body();
  } catch (...) {
    world.leave(rank);
    throw;
  }
}

}  // namespace flexep::host
