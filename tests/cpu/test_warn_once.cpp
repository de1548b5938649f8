// warn_once: a configuration warning is logged once per process, whatever the number of layers (and
// threads) that meet it; a different message is logged too.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "flexep/core/warn_once.h"

namespace flexep {
namespace {

TEST(WarnOnce, EachMessageOncePerProcess) {
  std::atomic<int> logged{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < 8; ++r)
    ranks.emplace_back([&] {
      for (int i = 0; i < 3; ++i) logged += warn_once("test message A (WarnOnce)") ? 1 : 0;
    });
  for (std::thread& t : ranks) t.join();
  EXPECT_EQ(logged.load(), 1);
  EXPECT_TRUE(warn_once("test message B (WarnOnce)"));
  EXPECT_FALSE(warn_once("test message A (WarnOnce)"));
  EXPECT_FALSE(warn_once("test message B (WarnOnce)"));
}

}  // namespace
}  // namespace flexep
