// detail::concat writes numbers and text without iostreams (error.h says why) but must give the
// bytes `std::ostream <<` gives with its defaults: every message and every test that reads one
// depends on that.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>

#include "flexep/core/error.h"
#include "dispatch/common/failed_arg.h"

namespace flexep {
namespace {

struct Streamed {
  int v;
};
std::ostream& operator<<(std::ostream& os, const Streamed& s) { return os << "Streamed(" << s.v << ")"; }

template <class T>
std::string streamed(const T& v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

template <class T>
void expect_as_streamed(const T& v) {
  EXPECT_EQ(detail::concat(v), streamed(v)) << "for " << streamed(v);
}

TEST(ErrorMessages, NumbersAreWrittenAsTheStreamWritesThem) {
  expect_as_streamed(0);
  expect_as_streamed(-1);
  expect_as_streamed(std::numeric_limits<int>::min());
  expect_as_streamed(std::numeric_limits<std::int64_t>::min());
  expect_as_streamed(std::numeric_limits<std::int64_t>::max());
  expect_as_streamed(std::numeric_limits<std::uint64_t>::max());
  expect_as_streamed(std::size_t{3000000000});
  expect_as_streamed(static_cast<short>(-7));
  expect_as_streamed(static_cast<unsigned short>(65535));
  for (double d : {0.0, -0.0, 0.1, 0.5, 1.0 / 3.0, 2.5, 100.0, 123456.0, 1234567.0, 1e-5, 1e-4, 1e20, -std::numeric_limits<double>::infinity(),
                   std::numeric_limits<double>::max(), std::numeric_limits<double>::denorm_min(),
                   std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()})
    expect_as_streamed(d);
  for (float f : {0.1f, 3.0e9f, -2.75f, 1e-7f}) expect_as_streamed(f);
  expect_as_streamed(true);
  expect_as_streamed(false);
  expect_as_streamed('x');
}

TEST(ErrorMessages, TextAndOtherTypesAreWrittenAsTheyAre) {
  const std::string s = "grad_out";
  const std::string_view v = "[4, 8]";
  const char* c = "expected";
  EXPECT_EQ(detail::concat(c, " shape ", v, " for '", s, "', got ", 3, " rows and ", Streamed{5}),
            "expected shape [4, 8] for 'grad_out', got 3 rows and Streamed(5)");
  EXPECT_EQ(detail::concat(), "");
}

TEST(ErrorMessages, APeersFailureNamesTheSameArgument) {
  try {
    raise_peer_failure(1, "combine:partials", failed_arg_of(std::make_exception_ptr(ArgumentError("grad_out", "x"))), 0,
                       "combine");
    FAIL() << "no exception";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "grad_out");
    EXPECT_NE(std::string(e.what()).find("rank 1 failed its checks in combine:partials"), std::string::npos) << e.what();
  }
  EXPECT_EQ(failed_arg_of(std::make_exception_ptr(Error("not an argument"))), FailedArg::other);
  EXPECT_THROW(raise_peer_failure(2, "combine_backward:rows", FailedArg::other, 0, "op"), Error);
}

}  // namespace
}  // namespace flexep
