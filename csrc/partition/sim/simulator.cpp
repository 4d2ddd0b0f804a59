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
  const int D = static_cast<int>(schedule.size());
  RANNC_CHECK(D >= 1 && S >= D && S % D == 0,
              "schedule has " << D << " devices, costs have " << S << " stages (a multiple is needed)");
  const int chunks = S / D;
  validateSchedule(schedule, micro_batches, chunks);
  const double kUnset = -1.0;
  std::vector<std::vector<double>> f_end(S, std::vector<double>(micro_batches, kUnset));
  std::vector<std::vector<double>> b_end = f_end;
  std::vector<size_t> next(D, 0);
  std::vector<double> free_at(D, 0.0);
  SimResult r;
  r.start.assign(D, {});
  size_t remaining = 0;
  for (const auto& a : schedule) remaining += a.size();
  auto stageOf = [&](int device, const Action& a) { return a.chunk * D + device; };
  // Sweep the devices until none can advance: start times only depend on finished work,
  // so the order of the sweep does not change the result.
  bool progress = true;
  while (remaining > 0 && progress) {
    progress = false;
    for (int d = 0; d < D; ++d) {
      while (next[d] < schedule[d].size()) {
        const Action& a = schedule[d][next[d]];
        const int m = a.micro_batch;
        const int i = stageOf(d, a);
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
        }  // a weight backward follows its input backward on the same device
        const double start = std::max(ready, free_at[d]);
        const bool fwd = a.kind == ActionKind::Forward;
        const double end = start + actionTime(stages[i], a.kind);
        if (a.kind != ActionKind::BackwardWeight) (fwd ? f_end : b_end)[i][m] = end;
        free_at[d] = end;
        r.start[d].push_back(start);
        ++next[d];
        --remaining;
        progress = true;
      }
    }
  }
  RANNC_CHECK(remaining == 0, "the schedule deadlocks with " << remaining << " actions left");

  r.finish.resize(D);
  r.busy.resize(D);
  r.bubble.resize(D);
  r.peak_in_flight.resize(D);
  r.peak_memory.resize(D);
  for (int d = 0; d < D; ++d) {
    // The device's chunks: their all-reduces start with the last backward and overlap it;
    // then each chunk's optimizer step.
    double allreduce = 0.0, update = 0.0, busy = 0.0;
    int64_t static_bytes = 0, working = 0;
    for (int c = 0; c < chunks; ++c) {
      const SimStage& st = stages[c * D + d];
      allreduce += st.allreduce_time;
      update += st.update_time;
      busy += micro_batches * (st.forward_time + st.backward_time);
      static_bytes += st.static_bytes;
      working = std::max(working, st.working_bytes);
    }
    const Action& final_action = schedule[d].back();
    const double last = actionTime(stages[stageOf(d, final_action)], final_action.kind);
    r.finish[d] = free_at[d] + std::max(0.0, allreduce - last) + update;
    r.busy[d] = busy;
    // Held from the forward to the end of the backward (its weight part, when split).
    int in_flight = 0, peak = 0;
    int64_t held = 0, peak_held = 0;
    for (const Action& a : schedule[d]) {
      if (a.kind == ActionKind::BackwardInput) continue;
      const int sign = a.kind == ActionKind::Forward ? 1 : -1;
      in_flight += sign;
      held += sign * stages[stageOf(d, a)].stash_bytes;
      peak = std::max(peak, in_flight);
      peak_held = std::max(peak_held, held);
    }
    r.peak_in_flight[d] = peak;
    r.peak_memory[d] = static_bytes + peak_held + working;
    r.iteration_time = std::max(r.iteration_time, r.finish[d]);
  }
  for (int d = 0; d < D; ++d) r.bubble[d] = r.iteration_time - r.busy[d];
  return r;
}

SimResult simulate(const std::vector<SimStage>& stages, ScheduleKind kind, int micro_batches, int chunks) {
  RANNC_CHECK(chunks >= 1 && stages.size() % chunks == 0,
              stages.size() << " stages do not split into " << chunks << " chunks per device");
  return simulate(stages, buildSchedule(kind, static_cast<int>(stages.size()) / chunks, micro_batches, chunks),
                  micro_batches);
}

}  // namespace rannc::partition
