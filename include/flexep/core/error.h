// One error family for the whole library. Every message names the argument (or phase), the
// offending value and what would have been allowed, so a user can fix the call without reading
// our source.
#pragma once

#include <charconv>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace flexep {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A caller passed something outside the allowed range. `argument()` is the parameter name as the
// user knows it ("indices", "moe.n_activated_experts", "handle", ...).
class ArgumentError : public Error {
 public:
  ArgumentError(std::string argument, const std::string& detail)
      : Error("flexep: invalid argument '" + argument + "': " + detail), argument_(std::move(argument)) {}
  const std::string& argument() const { return argument_; }

 private:
  std::string argument_;
};

// A peer did not arrive in time. `phase()` names the protocol step ("dispatch:count-exchange"),
// `peer()` the rank waited for (-1 when unknown).
class TimeoutError : public Error {
 public:
  TimeoutError(std::string phase, int peer, const std::string& detail)
      : Error("flexep: timeout in phase '" + phase + "'" +
              (peer >= 0 ? " waiting for rank " + std::to_string(peer) : std::string()) + ": " + detail),
        phase_(std::move(phase)),
        peer_(peer) {}
  const std::string& phase() const { return phase_; }
  int peer() const { return peer_; }

 private:
  std::string phase_;
  int peer_;
};

namespace detail {
// One piece of a message, as `std::ostream <<` writes it by default (bool as 1 / 0, floating point
// as %g with 6 digits). Numbers and text do not go through iostreams: their formatting reads the
// stream's locale facets, whose layout belongs to the libstdc++ the headers came from, and a process
// may run an older one (the Python interpreter loads the system's before it imports us: built with
// a newer GCC, a message with a number crashed the interpreter there).
template <class T>
void append(std::string& out, const T& v) {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, bool>) {
    out += v ? '1' : '0';
  } else if constexpr (std::is_same_v<U, char> || std::is_same_v<U, signed char> || std::is_same_v<U, unsigned char>) {
    out += static_cast<char>(v);
  } else if constexpr (std::is_integral_v<U> || std::is_floating_point_v<U>) {
    char buf[64];
    std::to_chars_result r;
    if constexpr (std::is_integral_v<U>) {
      r = std::to_chars(buf, buf + sizeof buf, v);
    } else {
      r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general, 6);
    }
    out.append(buf, r.ptr);
  } else if constexpr (std::is_convertible_v<const U&, std::string_view>) {
    out += std::string_view(v);
  } else {
    std::ostringstream os;
    os << v;
    out += os.str();
  }
}

template <class... Args>
std::string concat(Args&&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}
}  // namespace detail

template <class... Args>
[[noreturn]] void throw_argument_error(std::string argument, Args&&... detail) {
  throw ArgumentError(std::move(argument), detail::concat(std::forward<Args>(detail)...));
}

template <class... Args>
[[noreturn]] void throw_error(Args&&... detail) {
  throw Error("flexep: " + detail::concat(std::forward<Args>(detail)...));
}

}  // namespace flexep

// FLEXEP_CHECK_ARG(cond, "argument", message parts...): throws ArgumentError when cond is false.
#define FLEXEP_CHECK_ARG(cond, argument, ...)                  \
  do {                                                         \
    if (!(cond)) ::flexep::throw_argument_error((argument), __VA_ARGS__); \
  } while (0)

// FLEXEP_CHECK(cond, message parts...): an internal invariant or a state error (not an argument).
#define FLEXEP_CHECK(cond, ...)                       \
  do {                                                \
    if (!(cond)) ::flexep::throw_error(__VA_ARGS__);  \
  } while (0)
