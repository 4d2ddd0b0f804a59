#include "common/log.h"

#include <cstdlib>
#include <memory>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "common/error.h"
#include "common/log_fmt.h"

namespace rannc {
namespace {

spdlog::level::level_enum parseLevel(const std::string& name) {
  if (name == "trace") return spdlog::level::trace;
  if (name == "debug") return spdlog::level::debug;
  if (name == "info") return spdlog::level::info;
  if (name == "warn" || name == "warning") return spdlog::level::warn;
  if (name == "error") return spdlog::level::err;
  if (name == "off") return spdlog::level::off;
  throw Error("unknown log level '" + name + "' (expected trace, debug, info, warn, error or off)");
}

}  // namespace

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> lg = [] {
    auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    auto l = std::make_shared<spdlog::logger>("rannc", sink);
    l->set_pattern("[rannc %^%l%$] %v");
    const char* env = std::getenv("RANNC_LOG_LEVEL");
    l->set_level(env ? parseLevel(env) : spdlog::level::info);
    return l;
  }();
  return *lg;
}

namespace {

spdlog::level::level_enum toSpdlog(LogLevel level) {
  switch (level) {
    case LogLevel::Trace: return spdlog::level::trace;
    case LogLevel::Debug: return spdlog::level::debug;
    case LogLevel::Info: return spdlog::level::info;
    case LogLevel::Warn: return spdlog::level::warn;
    case LogLevel::Error: return spdlog::level::err;
    case LogLevel::Off: return spdlog::level::off;
  }
  return spdlog::level::info;
}

}  // namespace

void log(LogLevel level, const std::string& message) {
  logger().log(toSpdlog(level), "{}", message);
}

bool logEnabled(LogLevel level) { return logger().should_log(toSpdlog(level)); }

void setLogLevel(const std::string& level) { logger().set_level(parseLevel(level)); }

void setLogContext(int rank, int stage) {
  std::string prefix = "[rannc %^%l%$] [rank " + std::to_string(rank);
  if (stage >= 0) prefix += " | stage " + std::to_string(stage);
  logger().set_pattern(prefix + "] %v");
}

}  // namespace rannc
