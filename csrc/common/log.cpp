#include "common/log.h"

#include <cstdlib>

#include <spdlog/sinks/stdout_color_sinks.h>

#include "common/error.h"

namespace rannc {
namespace {

std::shared_ptr<spdlog::logger> makeLogger() {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto lg = std::make_shared<spdlog::logger>("rannc", sink);
  lg->set_pattern("[rannc %^%l%$] %v");
  const char* env = std::getenv("RANNC_LOG_LEVEL");
  lg->set_level(spdlog::level::from_str(env ? env : "info"));
  return lg;
}

}  // namespace

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> lg = makeLogger();
  return *lg;
}

void setLogLevel(const std::string& level) {
  auto lv = spdlog::level::from_str(level);
  if (lv == spdlog::level::off && level != "off") {
    throw Error("unknown log level '" + level +
                "' (expected trace, debug, info, warn, error, critical or off)");
  }
  logger().set_level(lv);
}

void setLogContext(int rank, int stage) {
  std::string prefix = "[rannc %^%l%$] [rank " + std::to_string(rank);
  if (stage >= 0) prefix += " | stage " + std::to_string(stage);
  logger().set_pattern(prefix + "] %v");
}

}  // namespace rannc
