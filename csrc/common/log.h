#pragma once
// Logging through spdlog, one logger for the library. Messages are prefixed with
// `[rank r | stage s]` once the runtime knows them; INFO once per phase, DEBUG per action.
#include <memory>
#include <string>

#include <spdlog/spdlog.h>

namespace rannc {

// The library's logger (created on first use, level from RANNC_LOG_LEVEL, default "info").
spdlog::logger& logger();

// Sets the level by name ("trace", "debug", "info", "warn", "error", "off").
void setLogLevel(const std::string& level);

// Sets the `[rank r | stage s]` prefix; a negative stage leaves it out.
void setLogContext(int rank, int stage);

}  // namespace rannc
