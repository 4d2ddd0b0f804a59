#include "partition/sim/schedule.h"

#include <algorithm>
#include <sstream>

#include "common/error.h"

namespace rannc::partition {

const char* scheduleName(ScheduleKind kind) {
  return kind == ScheduleKind::OneFOneB ? "1f1b" : "fill-drain";
}

Schedule buildSchedule(ScheduleKind kind, int stages, int micro_batches) {
  if (stages < 1 || micro_batches < 1) {
    throw InvalidGraphError("a schedule needs at least one stage and one micro-batch (got " +
                            std::to_string(stages) + " stages, " + std::to_string(micro_batches) +
                            " micro-batches)");
  }
  Schedule s(stages);
  for (int i = 0; i < stages; ++i) {
    auto& a = s[i];
    if (kind == ScheduleKind::FillDrain) {
      for (int m = 0; m < micro_batches; ++m) a.push_back({ActionKind::Forward, m});
      for (int m = 0; m < micro_batches; ++m) a.push_back({ActionKind::Backward, m});
      continue;
    }
    const int warmup = std::min(stages - 1 - i, micro_batches);
    int f = 0, b = 0;
    for (; f < warmup; ++f) a.push_back({ActionKind::Forward, f});
    while (f < micro_batches) {
      a.push_back({ActionKind::Forward, f++});
      a.push_back({ActionKind::Backward, b++});
    }
    while (b < micro_batches) a.push_back({ActionKind::Backward, b++});
  }
  return s;
}

int maxInFlight(ScheduleKind kind, int stage, int stages, int micro_batches) {
  return kind == ScheduleKind::OneFOneB ? std::min(stages - stage, micro_batches) : micro_batches;
}

void validateSchedule(const Schedule& schedule, int micro_batches) {
  for (size_t i = 0; i < schedule.size(); ++i) {
    std::vector<int> fwd(micro_batches, 0), bwd(micro_batches, 0);
    for (const Action& a : schedule[i]) {
      RANNC_CHECK(a.micro_batch >= 0 && a.micro_batch < micro_batches,
                  "stage " << i << " runs unknown micro-batch " << a.micro_batch);
      if (a.kind == ActionKind::Forward) {
        RANNC_CHECK(fwd[a.micro_batch]++ == 0, "stage " << i << " runs forward " << a.micro_batch << " twice");
      } else {
        RANNC_CHECK(fwd[a.micro_batch] == 1, "stage " << i << " runs backward " << a.micro_batch << " before its forward");
        RANNC_CHECK(bwd[a.micro_batch]++ == 0, "stage " << i << " runs backward " << a.micro_batch << " twice");
      }
    }
    for (int m = 0; m < micro_batches; ++m) {
      RANNC_CHECK(bwd[m] == 1, "stage " << i << " never runs backward " << m);
    }
  }
}

std::string formatSchedule(const Schedule& schedule) {
  std::ostringstream os;
  for (size_t i = 0; i < schedule.size(); ++i) {
    os << i << ":";
    for (const Action& a : schedule[i]) os << ' ' << (a.kind == ActionKind::Forward ? 'F' : 'B') << a.micro_batch;
    os << '\n';
  }
  return os.str();
}

}  // namespace rannc::partition
