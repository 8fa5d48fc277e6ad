// tally's error type and the check macro used at every API boundary. Messages say
// what was expected and what was found, naming the tensor, file or flag involved.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace tally {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
template <class... Args> std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace tally

// TALLY_CHECK(cond, "what", value, ...) throws tally::Error("tally: what value ...").
#define TALLY_CHECK(cond, ...)                                                   \
  do {                                                                           \
    if (!(cond)) throw ::tally::Error(::tally::detail::concat("tally: ", __VA_ARGS__)); \
  } while (0)

#define TALLY_FAIL(...) throw ::tally::Error(::tally::detail::concat("tally: ", __VA_ARGS__))
