#include "partition/sim/simulator.h"

#include <algorithm>

#include "common/error.h"

namespace rannc::partition {

double actionTime(const StageTimes& stage, ActionKind kind) {
  switch (kind) {
    case ActionKind::Forward: return stage.forward_time;
    case ActionKind::Backward: return stage.backward_time;
    case ActionKind::BackwardInput: return stage.backward_time - stage.weight_time;
    case ActionKind::BackwardWeight: return stage.weight_time;
  }
  return 0.0;
}

SimResult simulate(const std::vector<SimStage>& stages, const Schedule& schedule,
                   int micro_batches) {
  const int S = static_cast<int>(stages.size());
  RANNC_CHECK(S >= 1 && static_cast<int>(schedule.size()) == S,
              "schedule has " << schedule.size() << " stages, costs have " << S);
  validateSchedule(schedule, micro_batches);
  const double kUnset = -1.0;
  std::vector<std::vector<double>> f_end(S, std::vector<double>(micro_batches, kUnset));
  std::vector<std::vector<double>> b_end = f_end;
  std::vector<size_t> next(S, 0);
  std::vector<double> free_at(S, 0.0);
  SimResult r;
  r.start.assign(S, {});
  size_t remaining = 0;
  for (const auto& a : schedule) remaining += a.size();
  // Sweep the stages until none can advance: start times only depend on finished work,
  // so the order of the sweep does not change the result.
  bool progress = true;
  while (remaining > 0 && progress) {
    progress = false;
    for (int i = 0; i < S; ++i) {
      while (next[i] < schedule[i].size()) {
        const Action& a = schedule[i][next[i]];
        const int m = a.micro_batch;
        double ready = 0.0;
        if (a.kind == ActionKind::Forward) {
          if (i > 0) {
            if (f_end[i - 1][m] == kUnset) break;
            ready = f_end[i - 1][m] + stages[i - 1].send_forward_time;
          }
        } else if (a.kind != ActionKind::BackwardWeight) {
          if (f_end[i][m] == kUnset) break;
          ready = f_end[i][m];
          if (i + 1 < S) {
            if (b_end[i + 1][m] == kUnset) break;
            ready = std::max(ready, b_end[i + 1][m] + stages[i + 1].send_backward_time);
          }
        }  // a weight backward follows its input backward on the same stage
        const double start = std::max(ready, free_at[i]);
        const bool fwd = a.kind == ActionKind::Forward;
        const double end = start + actionTime(stages[i], a.kind);
        if (a.kind != ActionKind::BackwardWeight) (fwd ? f_end : b_end)[i][m] = end;
        free_at[i] = end;
        r.start[i].push_back(start);
        ++next[i];
        --remaining;
        progress = true;
      }
    }
  }
  RANNC_CHECK(remaining == 0, "the schedule deadlocks with " << remaining << " actions left");

  r.finish.resize(S);
  r.busy.resize(S);
  r.bubble.resize(S);
  r.peak_in_flight.resize(S);
  r.peak_memory.resize(S);
  for (int i = 0; i < S; ++i) {
    const SimStage& st = stages[i];
    // The all-reduce overlaps the stage's last action (a backward, or its weight part).
    const double last = actionTime(st, schedule[i].back().kind);
    r.finish[i] = free_at[i] + std::max(0.0, st.allreduce_time - last) + st.update_time;
    r.busy[i] = micro_batches * (st.forward_time + st.backward_time);
    int in_flight = 0, peak = 0;
    for (const Action& a : schedule[i]) {
      // held from the forward to the end of the backward (its weight part, when split)
      if (a.kind == ActionKind::BackwardInput) continue;
      in_flight += a.kind == ActionKind::Forward ? 1 : -1;
      peak = std::max(peak, in_flight);
    }
    r.peak_in_flight[i] = peak;
    r.peak_memory[i] = st.static_bytes + peak * st.stash_bytes + st.working_bytes;
    r.iteration_time = std::max(r.iteration_time, r.finish[i]);
  }
  for (int i = 0; i < S; ++i) r.bubble[i] = r.iteration_time - r.busy[i];
  return r;
}

SimResult simulate(const std::vector<SimStage>& stages, ScheduleKind kind, int micro_batches) {
  return simulate(stages, buildSchedule(kind, static_cast<int>(stages.size()), micro_batches),
                  micro_batches);
}

}  // namespace rannc::partition
