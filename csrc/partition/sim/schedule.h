#pragma once
// Pipeline schedules as data (STYLE.md): for each stage, the ordered list of micro-batch
// forwards and backwards it runs. Built by pure functions, printed, validated; the
// simulator here and the runtime engine both execute these lists, so there is one
// definition of each schedule.
#include <string>
#include <vector>

namespace rannc::partition {

enum class ScheduleKind {
  OneFOneB,   // synchronous 1F1B: warm-up forwards, one forward one backward, cool-down
  FillDrain,  // GPipe: all forwards, then all backwards
};
const char* scheduleName(ScheduleKind kind);

enum class ActionKind { Forward, Backward };

struct Action {
  ActionKind kind = ActionKind::Forward;
  int micro_batch = 0;
  bool operator==(const Action& o) const { return kind == o.kind && micro_batch == o.micro_batch; }
};

// actions[stage] in execution order.
using Schedule = std::vector<std::vector<Action>>;

// The schedule of `kind` for `stages` stages and `micro_batches` micro-batches (both >= 1;
// throws InvalidGraphError otherwise). In 1F1B stage i (0-based) first runs
// min(stages - 1 - i, micro_batches) forwards.
Schedule buildSchedule(ScheduleKind kind, int stages, int micro_batches);

// Micro-batches whose activations stage `stage` holds at most under `kind`:
// min(stages - stage, micro_batches) for 1F1B, micro_batches for fill-drain.
int maxInFlight(ScheduleKind kind, int stage, int stages, int micro_batches);

// Checks every stage runs each micro-batch's forward once, then its backward once;
// throws InternalError naming the first violation.
void validateSchedule(const Schedule& schedule, int micro_batches);

// One line per stage: "0: F0 F1 B0 F2 B1 B2".
std::string formatSchedule(const Schedule& schedule);

}  // namespace rannc::partition
