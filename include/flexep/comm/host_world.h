// R simulated ranks in one process, one thread per rank, exchanging through shared memory. This
// is the transport of the `host` backend: a rank publishes a pointer to its data, the ranks meet
// at a barrier, and each reads what the others published. Every wait has a deadline: a rank
// that never arrives makes the others fail with a TimeoutError naming the phase and that rank,
// after which the world is broken and every later call fails at once.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "flexep/comm/process_group.h"

namespace flexep {

class HostWorld {
 public:
  explicit HostWorld(int size, double timeout_seconds = 300.0);
  int size() const { return size_; }
  double timeout_seconds() const { return timeout_seconds_; }
  void set_timeout_seconds(double s) { timeout_seconds_ = s; }
  // The lowest-ranked rank waiting in a collective for `seconds` (10 by default; a wait shorter
  // than the deadline only) says what it waits for, once per wait, through `notice` (empty: a
  // warning in the log): a slow or missing peer shows long before the deadline (300 s by default).
  void set_notice(double seconds, std::function<void(const std::string&)> notice = {});

  // Blocks until all ranks arrived at this barrier (same call count on every rank).
  void barrier(int rank, const std::string& phase);
  // Every rank passes a pointer; returns all ranks' pointers, index = rank. The pointees must
  // stay valid until the ranks have passed a later barrier. A rank reads what it gathered until it
  // enters its next collective (or leave()s); a rank that leaves a collective by an error (a
  // timeout, a broken world) first waits for every peer still reading, up to one more deadline, so
  // that unwinding does not free rows a slow peer reads.
  std::vector<const void*> all_gather_ptr(int rank, const void* mine, const std::string& phase);
  bool broken() const;
  // For a rank that leaves its call by an error of its own between collectives (not one a
  // collective raised): it stops reading, and waits, as a collective's error does, for the peers
  // still reading its rows.
  void leave(int rank);

  // Fault injection, for tests: the next time `rank` reaches the collective `phase` (a barrier or
  // an all-gather of that name) it stops there as a dead rank would, never arriving
  // (stall_seconds < 0; its thread throws InjectedFault once the others' deadline broke the world),
  // or sleeps stall_seconds and then enters as a stalled one would. With `after`, the rank instead
  // passes the collective and then sleeps stall_seconds before going on: a slow reader of what an
  // all-gather gave it. Each fault fires once.
  struct Fault {
    int rank = 0;
    std::string phase;
    double stall_seconds = -1.0;
    bool after = false;
  };
  void inject(Fault fault);
  // The collectives each rank entered while tracing was on, in order (to find where to inject).
  void trace(bool on);
  std::vector<std::string> traced(int rank) const;

 private:
  void fire_fault(int rank, const std::string& phase, bool after);
  void meet(int rank, const std::string& phase);  // the barrier itself
  // Before a rank leaves a collective by an error: up to the deadline, until no peer still reads
  // what it gathered (its caller frees the rows this rank published once the error unwinds).
  void wait_for_readers(std::unique_lock<std::mutex>& lock, int rank);
  int first_present() const;          // of the barrier being filled (under the lock)
  std::string missing_ranks() const;  // "1, 3"

  const int size_;
  double timeout_seconds_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::uint64_t generation_ = 0;
  int arrived_ = 0;
  std::vector<bool> present_;              // who arrived at the current barrier
  std::vector<std::uint64_t> exchanges_;   // per-rank exchange count (slot parity)
  std::vector<const void*> slots_[2];
  std::vector<bool> reading_;  // passed an all-gather, not yet in its next collective
  std::string broken_reason_;
  std::string phase_;          // phase of the barrier being filled (a mismatch is a protocol error)
  std::string broken_phase_;   // set when a timeout broke the world: ranks waiting in that barrier
  int broken_peer_ = -1;       // get the TimeoutError, later callers a plain Error
  std::vector<Fault> faults_;  // injected, not yet fired
  double notice_seconds_ = 10.0;
  std::function<void(const std::string&)> notice_;
  bool tracing_ = false;
  std::vector<std::vector<std::string>> traced_;  // per rank
};

// What a rank stopped by HostWorld::inject throws.
class InjectedFault : public Error {
 public:
  using Error::Error;
};

// ProcessGroup over a HostWorld (one object per rank).
class HostProcessGroup : public ProcessGroup {
 public:
  HostProcessGroup(std::shared_ptr<HostWorld> world, int rank);
  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  void all_reduce_sum(const TensorView& t, const std::string& what) override;
  void barrier(const std::string& what) override { world_->barrier(rank_, what); }
  const std::shared_ptr<HostWorld>& world() const { return world_; }

 private:
  std::shared_ptr<HostWorld> world_;
  int rank_;
};

}  // namespace flexep
