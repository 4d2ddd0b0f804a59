#pragma once
// Logging through spdlog, one logger for the library, with `[rank r | stage s]` prefixes
// once the runtime knows them; INFO once per phase, DEBUG per action.
//
// [Note: no spdlog in headers] torch ships its own copy of fmt, which clashes with the fmt
// that Debian's spdlog is built against; so spdlog stays inside log.cpp and callers pass
// finished strings (build them with std::ostringstream or std::to_string).
#include <string>

namespace rannc {

enum class LogLevel { Trace, Debug, Info, Warn, Error, Off };

// Writes one message at `level` (dropped below the current level).
void log(LogLevel level, const std::string& message);
inline void logDebug(const std::string& message) { log(LogLevel::Debug, message); }
inline void logInfo(const std::string& message) { log(LogLevel::Info, message); }
inline void logWarn(const std::string& message) { log(LogLevel::Warn, message); }

// Whether a message at `level` would be written (to skip building expensive messages).
bool logEnabled(LogLevel level);

// Sets the level by name ("trace", "debug", "info", "warn", "error", "off"); the
// initial level comes from RANNC_LOG_LEVEL (default "info"). Throws rannc::Error on an
// unknown name.
void setLogLevel(const std::string& level);

// Sets the `[rank r | stage s]` prefix; a negative stage leaves it out.
void setLogContext(int rank, int stage);

}  // namespace rannc
