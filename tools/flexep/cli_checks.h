// Validators of the CLI's numeric options (CLI11): the allowed range in readable numbers, and a
// value that is not a number (or not finite) said so, e.g.
//   --steps: expected a whole number from 1 to 1000000000, got 'abc'
#pragma once

#include <CLI/CLI.hpp>

namespace flexep::tools {

// An integer in [lo, hi] (written in decimal, no fraction, no exponent).
CLI::Validator whole_number(long long lo, long long hi);

// A finite number greater than `above` (NaN and infinities refused).
CLI::Validator finite_number_above(double above);

}  // namespace flexep::tools
