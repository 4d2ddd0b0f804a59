#pragma once
// fmt-style logging (`logger().info("{} blocks", n)`) for translation units that do not
// include torch; see [Note: no spdlog in headers] in log.h. Torch-facing code uses log.h.
#include <spdlog/spdlog.h>

#include "common/log.h"

namespace rannc {

// The library's logger (same sink, level and prefix as log()).
spdlog::logger& logger();

}  // namespace rannc
