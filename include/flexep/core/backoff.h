// The pause between two polls of a host-side wait (for the GPU, or for a peer through NCCL):
// yield for the first 5 ms, then sleep. sleep_for(20 us) really sleeps ~70-100 us on Linux (timer
// slack), which a short wait would pay on every call: a blocking dispatch's count exchange is tens
// of microseconds (deepep: 391 -> 245 us per call when Communicator::wait stopped sleeping at once),
// and a DSV3-size hybridep dispatch's kernels take ~0.6 ms (775 -> 690 us with a 5 ms spin instead
// of a 200 us one, 2x H200). After 5 ms the sleeps keep a long wait (a slow peer) from burning a core.
#pragma once

#include <chrono>
#include <thread>

namespace flexep {

class PollBackoff {
 public:
  explicit PollBackoff(std::chrono::microseconds sleep) : sleep_(sleep) {}
  void pause() const {
    if (std::chrono::steady_clock::now() < spin_until_)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(sleep_);
  }

 private:
  std::chrono::microseconds sleep_;
  std::chrono::steady_clock::time_point spin_until_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(5);
};

}  // namespace flexep
