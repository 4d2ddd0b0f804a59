#pragma once
// One exception family for the whole library. Library code never exits or aborts:
// inside Python that would kill the user's interpreter. The binding layer maps each
// type to a Python exception class of the same name.
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace rannc {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The graph is malformed, or an operation on it is invalid (a non-convex set, say).
class InvalidGraphError : public Error {
 public:
  using Error::Error;
};

// The model cannot be traced faithfully (data-dependent control flow, batch size baked
// into a shape, an argument of a type that cannot be traced).
class TraceError : public Error {
 public:
  using Error::Error;
};

// A saved file is corrupt, truncated, of another kind or of an unsupported version.
class SerializationError : public Error {
 public:
  using Error::Error;
};

// No plan fits; carries the smallest memory per device that some plan would need.
class InfeasiblePlanError : public Error {
 public:
  InfeasiblePlanError(const std::string& what, int64_t bytes_needed)
      : Error(what), bytes_needed_(bytes_needed) {}
  int64_t bytesNeeded() const { return bytes_needed_; }

 private:
  int64_t bytes_needed_;
};

// A communication failed, or a peer rank reported a failure; names this rank, the peer
// and the operation.
class CommError : public Error {
 public:
  using Error::Error;
};

// A blocking wait ran past its deadline (another rank is stuck or gone).
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

// A broken internal invariant: a bug in rannc, reported with file and line.
class InternalError : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] void throwInternal(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

}  // namespace rannc

// Checks an internal invariant; throws rannc::InternalError naming file:line.
#define RANNC_CHECK(cond, msg)                                                        \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::ostringstream rannc_check_os_;                                             \
      rannc_check_os_ << msg;                                                         \
      ::rannc::detail::throwInternal(__FILE__, __LINE__, #cond, rannc_check_os_.str()); \
    }                                                                                 \
  } while (0)
