// Test helper: runs one lambda per simulated rank, each on its own thread, and collects what each
// rank threw. Assertions about the outcome run afterwards on the main thread.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace flexep::testing {

// fn(rank) on R threads; result[r] is what rank r threw (null: returned normally).
inline std::vector<std::exception_ptr> run_ranks(int R, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(R));
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

inline std::string what_of(const std::exception_ptr& e) {
  if (!e) return "(no exception)";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "(non-standard exception)";
  }
}

// Every rank returned normally; otherwise reports each rank's error.
inline ::testing::AssertionResult all_ok(const std::vector<std::exception_ptr>& errors) {
  ::testing::AssertionResult ok = ::testing::AssertionSuccess();
  bool failed = false;
  std::string msg;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (errors[r]) {
      failed = true;
      msg += "\n  rank " + std::to_string(r) + ": " + what_of(errors[r]);
    }
  if (failed) return ::testing::AssertionFailure() << "ranks threw:" << msg;
  return ok;
}

// Every rank threw an E for which check(e) holds.
template <class E, class Check>
::testing::AssertionResult all_threw(const std::vector<std::exception_ptr>& errors, Check check) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) return ::testing::AssertionFailure() << "rank " << r << " threw nothing";
    try {
      std::rethrow_exception(errors[r]);
    } catch (const E& e) {
      if (!check(e)) return ::testing::AssertionFailure() << "rank " << r << " threw an unexpected error: " << e.what();
    } catch (...) {
      return ::testing::AssertionFailure() << "rank " << r << " threw another type: " << what_of(errors[r]);
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace flexep::testing
