#include "partition/sim/schedule.h"

#include <algorithm>
#include <sstream>

#include "common/error.h"

namespace rannc::partition {

const char* scheduleName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::OneFOneB: return "1f1b";
    case ScheduleKind::FillDrain: return "fill-drain";
    case ScheduleKind::ZeroBubbleH1: return "zb-h1";
    case ScheduleKind::Auto: return "auto";
  }
  return "?";
}

const char* actionName(ActionKind kind) {
  switch (kind) {
    case ActionKind::Forward: return "F";
    case ActionKind::Backward: return "B";
    case ActionKind::BackwardInput: return "Bi";
    case ActionKind::BackwardWeight: return "W";
  }
  return "?";
}

bool splitsBackward(ScheduleKind kind) { return kind == ScheduleKind::ZeroBubbleH1; }

Schedule buildSchedule(ScheduleKind kind, int stages, int micro_batches) {
  if (stages < 1 || micro_batches < 1) {
    throw InvalidGraphError("a schedule needs at least one stage and one micro-batch (got " +
                            std::to_string(stages) + " stages, " + std::to_string(micro_batches) +
                            " micro-batches)");
  }
  if (kind == ScheduleKind::Auto) {
    throw InvalidGraphError("schedule auto is a planner option: a plan names the schedule it chose");
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
    const bool split = splitsBackward(kind);
    const int defer = split ? i : 0;  // [Note: ZB-H1]
    int f = 0, b = 0, w = 0;
    auto backward = [&] {
      a.push_back({split ? ActionKind::BackwardInput : ActionKind::Backward, b++});
      if (split && b - w > defer) a.push_back({ActionKind::BackwardWeight, w++});
    };
    for (; f < warmup; ++f) a.push_back({ActionKind::Forward, f});
    while (f < micro_batches) {
      a.push_back({ActionKind::Forward, f++});
      backward();
    }
    while (b < micro_batches) backward();
    while (split && w < micro_batches) a.push_back({ActionKind::BackwardWeight, w++});
  }
  return s;
}

int maxInFlight(ScheduleKind kind, int stage, int stages, int micro_batches) {
  switch (kind) {
    case ScheduleKind::OneFOneB: return std::min(stages - stage, micro_batches);
    case ScheduleKind::ZeroBubbleH1: return std::min(stages, micro_batches);
    case ScheduleKind::FillDrain:
    case ScheduleKind::Auto: return micro_batches;
  }
  return micro_batches;
}

void validateSchedule(const Schedule& schedule, int micro_batches) {
  for (size_t i = 0; i < schedule.size(); ++i) {
    // per micro-batch: 0 nothing, 1 forward done, 2 input backward done, 3 backward done
    std::vector<int> done(micro_batches, 0);
    for (const Action& a : schedule[i]) {
      const int m = a.micro_batch;
      RANNC_CHECK(m >= 0 && m < micro_batches, "stage " << i << " runs unknown micro-batch " << m);
      const int before = a.kind == ActionKind::Forward         ? 0
                         : a.kind == ActionKind::BackwardWeight ? 2
                                                                : 1;
      RANNC_CHECK(done[m] == before, "stage " << i << " runs " << actionName(a.kind) << m
                                              << (done[m] > before ? " twice or too late" : " too early"));
      done[m] = a.kind == ActionKind::Forward ? 1 : a.kind == ActionKind::BackwardInput ? 2 : 3;
    }
    for (int m = 0; m < micro_batches; ++m) {
      RANNC_CHECK(done[m] == 3, "stage " << i << " never finishes the backward of " << m);
    }
  }
}

std::string formatSchedule(const Schedule& schedule) {
  std::ostringstream os;
  for (size_t i = 0; i < schedule.size(); ++i) {
    os << i << ":";
    for (const Action& a : schedule[i]) os << ' ' << actionName(a.kind) << a.micro_batch;
    os << '\n';
  }
  return os.str();
}

}  // namespace rannc::partition
