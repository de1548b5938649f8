#include "flexep/comm/host_world.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include <spdlog/spdlog.h>

#include "flexep/core/checks.h"

namespace flexep {

namespace {
std::string fmt_seconds(double s) { return detail::concat(s, " s"); }

void check_rank(int rank, int size) {
  FLEXEP_CHECK_ARG(rank >= 0 && rank < size, "rank", rank, " is out of range [0, ", size, ")");
}
}  // namespace

HostWorld::HostWorld(int size, double timeout_seconds) : size_(size), timeout_seconds_(timeout_seconds) {
  FLEXEP_CHECK_ARG(size >= 1, "size", "a host world needs at least 1 rank, got ", size);
  FLEXEP_CHECK_ARG(timeout_seconds > 0.0, "timeout_seconds", "must be > 0, got ", timeout_seconds);
  present_.assign(static_cast<std::size_t>(size), false);
  reading_.assign(static_cast<std::size_t>(size), false);
  exchanges_.assign(static_cast<std::size_t>(size), 0);
  slots_[0].assign(static_cast<std::size_t>(size), nullptr);
  slots_[1].assign(static_cast<std::size_t>(size), nullptr);
}

bool HostWorld::broken() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !broken_reason_.empty();
}

void HostWorld::inject(Fault fault) {
  check_rank(fault.rank, size_);
  FLEXEP_CHECK_ARG(!fault.phase.empty(), "fault.phase", "must name a collective (e.g. 'combine:exchange')");
  const std::lock_guard<std::mutex> lock(mutex_);
  faults_.push_back(std::move(fault));
}

void HostWorld::trace(bool on) {
  const std::lock_guard<std::mutex> lock(mutex_);
  tracing_ = on;
  if (on) traced_.assign(static_cast<std::size_t>(size_), {});
}

std::vector<std::string> HostWorld::traced(int rank) const {
  check_rank(rank, size_);
  const std::lock_guard<std::mutex> lock(mutex_);
  return traced_.empty() ? std::vector<std::string>{} : traced_[static_cast<std::size_t>(rank)];
}

void HostWorld::fire_fault(int rank, const std::string& phase, bool after) {
  double stall = 0.0;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!after) {
      // Entering a collective ends the reads of the last all-gather's rows.
      if (reading_[static_cast<std::size_t>(rank)]) {
        reading_[static_cast<std::size_t>(rank)] = false;
        cv_.notify_all();
      }
      if (tracing_) traced_[static_cast<std::size_t>(rank)].push_back(phase);
    }
    const auto it = std::find_if(faults_.begin(), faults_.end(), [&](const Fault& f) {
      return f.rank == rank && f.phase == phase && f.after == after;
    });
    if (it == faults_.end()) return;
    stall = it->stall_seconds;
    faults_.erase(it);
  }
  if (after) {
    std::this_thread::sleep_for(std::chrono::duration<double>(std::max(stall, 0.0)));
    return;
  }
  if (stall >= 0.0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(stall));
    return;
  }
  // A dead rank never arrives, and its memory stays where it was: peers may still read what it
  // published (the exchange before a ":done" barrier). It unwinds once the others have given up
  // on it and none of them still reads.
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return !broken_reason_.empty(); });
  wait_for_readers(lock, rank);
  throw InjectedFault(detail::concat("flexep: injected fault: rank ", rank, " stopped at '", phase, "'"));
}

void HostWorld::barrier(int rank, const std::string& phase) {
  check_rank(rank, size_);
  fire_fault(rank, phase, false);
  meet(rank, phase);
  fire_fault(rank, phase, true);
}

void HostWorld::set_notice(double seconds, std::function<void(const std::string&)> notice) {
  FLEXEP_CHECK_ARG(seconds > 0.0, "seconds", "must be > 0, got ", seconds);
  const std::lock_guard<std::mutex> lock(mutex_);
  notice_seconds_ = seconds;
  notice_ = std::move(notice);
}

int HostWorld::first_present() const {
  for (int r = 0; r < size_; ++r)
    if (present_[static_cast<std::size_t>(r)]) return r;
  return -1;
}

std::string HostWorld::missing_ranks() const {
  std::string missing;
  for (int r = 0; r < size_; ++r)
    if (!present_[static_cast<std::size_t>(r)]) missing += detail::concat(missing.empty() ? "" : ", ", r);
  return missing;
}

void HostWorld::leave(int rank) {
  check_rank(rank, size_);
  std::unique_lock<std::mutex> lock(mutex_);
  if (reading_[static_cast<std::size_t>(rank)]) {
    reading_[static_cast<std::size_t>(rank)] = false;
    cv_.notify_all();
  }
  wait_for_readers(lock, rank);
}

void HostWorld::wait_for_readers(std::unique_lock<std::mutex>& lock, int rank) {
  // A reader is a live thread copying rows; it ends at its next collective, which fails at once
  // in a broken world, or at leave(). A reader gets one more deadline: past it the rows are freed
  // under it, rather than this rank hanging.
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_seconds_));
  cv_.wait_until(lock, deadline, [&] {
    for (int r = 0; r < size_; ++r)
      if (r != rank && reading_[static_cast<std::size_t>(r)]) return false;
    return true;
  });
}

void HostWorld::meet(int rank, const std::string& phase) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!broken_reason_.empty()) {
    wait_for_readers(lock, rank);
    throw_error("host world is broken (", broken_reason_, "); rank ", rank, " cannot enter '", phase,
                "'. Recreate the world after fixing the cause");
  }
  FLEXEP_CHECK(!present_[static_cast<std::size_t>(rank)], "host world: rank ", rank, " entered barrier '", phase,
               "' twice; each rank must be driven by exactly one thread");
  if (arrived_ == 0) {
    phase_ = phase;
  } else if (phase != phase_) {
    // Ranks in different collectives would pair unrelated exchanges and read each other's data
    // wrongly; stop everyone instead.
    broken_reason_ = detail::concat("rank ", rank, " entered '", phase, "' while other ranks wait in '", phase_,
                                    "'; every rank must make the same collective calls in the same order");
    cv_.notify_all();
    wait_for_readers(lock, rank);
    throw_error("host world: ", broken_reason_);
  }
  present_[static_cast<std::size_t>(rank)] = true;
  if (++arrived_ == size_) {
    arrived_ = 0;
    present_.assign(static_cast<std::size_t>(size_), false);
    ++generation_;
    cv_.notify_all();
    return;
  }
  const std::uint64_t gen = generation_;
  const double timeout = timeout_seconds_;
  const auto start = std::chrono::steady_clock::now();
  auto after = [&](double s) {
    return start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
  };
  const auto done = [&] { return generation_ != gen || !broken_reason_.empty(); };
  bool released = false;
  if (notice_seconds_ < timeout) {
    released = cv_.wait_until(lock, after(notice_seconds_), done);
    if (!released && rank == first_present()) {
      const std::string message = detail::concat("flexep: rank ", rank, " has waited ", fmt_seconds(notice_seconds_),
                                                 " in '", phase, "' for rank(s) ", missing_ranks(), " (deadline ",
                                                 fmt_seconds(timeout), ")");
      if (notice_) notice_(message);
      else spdlog::warn("{}", message);
    }
  }
  if (!released) released = cv_.wait_until(lock, after(timeout), done);
  if (generation_ != gen) return;  // completed, even if the world broke right after
  if (released) {
    wait_for_readers(lock, rank);
    // Broken while we waited: a timeout of this same barrier reads as a timeout on every waiter.
    if (broken_peer_ >= 0 && broken_phase_ == phase) throw TimeoutError(phase, broken_peer_, broken_reason_);
    throw_error("host world is broken (", broken_reason_, "); rank ", rank, " was waiting in '", phase, "'");
  }
  int missing = -1;
  std::string present;
  for (int r = 0; r < size_; ++r) {
    if (present_[static_cast<std::size_t>(r)])
      present += detail::concat(present.empty() ? "" : ", ", r);
    else if (missing < 0)
      missing = r;
  }
  broken_reason_ = detail::concat("rank ", missing, " did not arrive at '", phase, "' after ", fmt_seconds(timeout),
                                  "; ranks present: ", present, " of ", size_,
                                  " (a rank crashed, returned early, or made a different collective call)");
  broken_phase_ = phase;
  broken_peer_ = missing;
  cv_.notify_all();
  wait_for_readers(lock, rank);
  throw TimeoutError(phase, missing, broken_reason_);
}

std::vector<const void*> HostWorld::all_gather_ptr(int rank, const void* mine, const std::string& phase) {
  check_rank(rank, size_);
  fire_fault(rank, phase, false);  // before publishing: a stopped rank leaves nothing behind for the others
  std::size_t parity;
  {
    // A fast rank may publish its next exchange while a slow one still reads this one; the next
    // exchange writes the other array, and the one after needs the slow rank at a barrier first.
    std::lock_guard<std::mutex> lock(mutex_);
    parity = static_cast<std::size_t>(exchanges_[static_cast<std::size_t>(rank)]++ & 1u);
    slots_[parity][static_cast<std::size_t>(rank)] = mine;
  }
  meet(rank, phase);
  std::vector<const void*> all;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    reading_[static_cast<std::size_t>(rank)] = true;
    all = slots_[parity];
  }
  fire_fault(rank, phase, true);
  return all;
}

HostProcessGroup::HostProcessGroup(std::shared_ptr<HostWorld> world, int rank) : world_(std::move(world)), rank_(rank) {
  FLEXEP_CHECK_ARG(world_ != nullptr, "world", "is null");
  check_rank(rank, world_->size());
}

namespace {
template <class T>
void sum_ascending(const std::vector<TensorView>& views, std::vector<T>& acc) {
  const std::size_t n = acc.size();
  for (std::size_t i = 0; i < n; ++i) acc[i] = static_cast<const T*>(views[0].data)[i];
  for (std::size_t r = 1; r < views.size(); ++r) {
    const T* src = static_cast<const T*>(views[r].data);
    for (std::size_t i = 0; i < n; ++i) acc[i] += src[i];
  }
}

template <class T>
void reduce_into(const std::vector<TensorView>& views, const TensorView& mine, HostWorld& world, int rank,
                 const std::string& done_phase) {
  std::vector<T> acc(static_cast<std::size_t>(mine.numel()));
  if (!acc.empty()) sum_ascending<T>(views, acc);
  world.barrier(rank, done_phase);  // every rank has read every buffer; now each may overwrite its own
  if (!acc.empty()) std::memcpy(mine.data, acc.data(), acc.size() * sizeof(T));
}
}  // namespace

// Sums in the tensor's own dtype (f32 stays f32), rank 0 first: the result is bitwise identical on
// every rank and from run to run.
void HostProcessGroup::all_reduce_sum(const TensorView& t, const std::string& what) {
  std::string local_error;
  if (!t.defined())
    local_error = "tensor is undefined";
  else if (!t.device.is_cpu())
    local_error = "tensor is on " + t.device.str() + "; the host world needs CPU tensors";
  else if (t.dtype != DType::f32 && t.dtype != DType::f64 && t.dtype != DType::i64)
    local_error = "dtype " + std::string(dtype_name(t.dtype)) + " is not supported; allowed: f32, f64, i64";
  struct Published {
    TensorView view;
    const std::string* error;
  } mine{t, &local_error};
  const std::string phase = "all_reduce_sum:" + what;
  const auto ptrs = world_->all_gather_ptr(rank_, &mine, phase);
  std::vector<TensorView> views;
  std::string mismatch;
  for (int r = 0; r < size(); ++r) {
    const auto* p = static_cast<const Published*>(ptrs[static_cast<std::size_t>(r)]);
    views.push_back(p->view);
    if (mismatch.empty() && !p->error->empty()) mismatch = "rank " + std::to_string(r) + ": " + *p->error;
  }
  if (mismatch.empty())
    for (int r = 1; r < size(); ++r) {
      const TensorView& a = views[0];
      const TensorView& b = views[static_cast<std::size_t>(r)];
      if (a.shape != b.shape || a.dtype != b.dtype) {
        mismatch = "rank " + std::to_string(r) + " passes " + std::string(dtype_name(b.dtype)) + " " + b.shape.str() +
                   " but rank 0 passes " + std::string(dtype_name(a.dtype)) + " " + a.shape.str() +
                   "; all ranks must reduce tensors of the same shape and dtype";
        break;
      }
    }
  const std::string done = phase + ":done";
  if (!mismatch.empty()) {
    world_->barrier(rank_, done);  // the others may still read our Published
    throw_argument_error(what, mismatch);
  }
  switch (t.dtype) {
    case DType::f32:
      reduce_into<float>(views, t, *world_, rank_, done);
      break;
    case DType::f64:
      reduce_into<double>(views, t, *world_, rank_, done);
      break;
    default:
      reduce_into<std::int64_t>(views, t, *world_, rank_, done);
      break;
  }
}

}  // namespace flexep
