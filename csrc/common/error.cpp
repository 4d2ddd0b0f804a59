#include "common/error.h"

namespace rannc::detail {

void throwInternal(const char* file, int line, const char* cond, const std::string& msg) {
  std::ostringstream os;
  os << "internal error at " << file << ":" << line << ": check `" << cond << "` failed";
  if (!msg.empty()) os << ": " << msg;
  os << " (this is a bug in rannc; please report it)";
  throw InternalError(os.str());
}

}  // namespace rannc::detail
