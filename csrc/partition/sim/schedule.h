#pragma once
// Pipeline schedules as data (STYLE.md): for each stage, the ordered list of micro-batch
// forwards and backwards it runs. Built by pure functions, printed, validated; the
// simulator here and the runtime engine both execute these lists, so there is one
// definition of each schedule.
#include <string>
#include <vector>

namespace rannc::partition {

enum class ScheduleKind {
  OneFOneB,      // synchronous 1F1B: warm-up forwards, one forward one backward, cool-down
  FillDrain,     // GPipe: all forwards, then all backwards
  ZeroBubbleH1,  // ZB-H1 (Qi et al., ICLR 2024): 1F1B with each backward split ([Note: ZB-H1])
  Interleaved,   // interleaved 1F1B (Narayanan et al., SC 2021): chunks of the model per device ([Note: interleaved 1F1B])
  // A planner option only: the stage search plans each schedule the runtime runs with a
  // loss (1F1B, ZB-H1, interleaved) and keeps the fastest ([Note: schedule choice] in planner.cpp). A
  // plan always names a concrete schedule; buildSchedule refuses this one.
  Auto,
};
const char* scheduleName(ScheduleKind kind);

// Backward is the whole backward of a micro-batch; a split backward runs BackwardInput
// (the gradients of the stage's inputs, which the previous stage waits for) and later
// BackwardWeight (the parameters' gradients, which nobody waits for).
enum class ActionKind { Forward, Backward, BackwardInput, BackwardWeight };
const char* actionName(ActionKind kind);  // "F", "B", "Bi", "W"

struct Action {
  ActionKind kind = ActionKind::Forward;
  int micro_batch = 0;
  int chunk = 0;  // which of the device's chunks; its stage is chunk x devices + device
  bool operator==(const Action& o) const {
    return kind == o.kind && micro_batch == o.micro_batch && chunk == o.chunk;
  }
};

// actions[device] in execution order. Device d (a pipeline position) runs chunk c of the
// model as stage c x devices + d; with one chunk per device, device d is stage d.
using Schedule = std::vector<std::vector<Action>>;

// [Note: interleaved 1F1B] With v chunks per device the model is cut into v x D stages and
// device d holds stages d, D + d, 2D + d, ...: a micro-batch crosses every device v times,
// each time on a stage v times shorter, so the fill and drain shrink to 1/v of 1F1B's
// while the steady state is unchanged. Every device runs the same order of (chunk,
// micro-batch) forwards: micro-batches go in groups of D, each group through chunk 0,
// then chunk 1, ...; backwards likewise, chunks in reverse. Device d first runs
// 2 (D - 1 - d) + (v - 1) D forwards, then one forward one backward, then the drain (the
// schedule of Megatron-LM). The micro-batch count must be a multiple of D, so every group
// is whole. The price: v times the sends, and device d holds up to that warm-up + 1
// forwards of stages v times smaller.

// [Note: ZB-H1] Splitting the backward lets a stage send its input gradients before it
// computes its weight gradients, so the backward wave crosses each stage in the time of
// BackwardInput alone. Stage i runs 1F1B's warm-up forwards, then per forward F B, and
// defers each W by i positions (the last stage the most): the deferred Ws fill the
// cool-down, where 1F1B idles. A micro-batch is held from F to W, so stage i holds at most
// (stages - i) + i = stages micro-batches, 1F1B's peak (stage 0's). With equal F, B and W
// the bubble is (stages - 1)(F + B - W), a third of 1F1B's (stages - 1)(F + B + W).
//
// The schedule of `kind` for `devices` pipeline positions, `micro_batches` micro-batches
// and `chunks` chunks per device (all >= 1; chunks > 1 only, and required, for
// Interleaved, whose micro-batches must be a multiple of the devices; throws
// InvalidGraphError otherwise, and for Auto). In 1F1B and ZB-H1 stage i (0-based) first
// runs min(stages - 1 - i, micro_batches) forwards.
Schedule buildSchedule(ScheduleKind kind, int devices, int micro_batches, int chunks = 1);

// Micro-batches whose activations stage `stage` of `stages` holds at most under `kind`
// (from a forward to the end of its backward): min(stages - stage, micro_batches) for
// 1F1B, min(stages, micro_batches) for ZB-H1, micro_batches for fill-drain; for
// Interleaved (stages = chunks x devices) counted on its schedule.
int maxInFlight(ScheduleKind kind, int stage, int stages, int micro_batches, int chunks = 1);

// Checks every device runs each micro-batch's forward once per chunk, then either its
// backward once or its input backward once and later its weight backward once; throws
// InternalError naming the first violation.
void validateSchedule(const Schedule& schedule, int micro_batches, int chunks = 1);

// Whether the schedule splits backwards (BackwardInput / BackwardWeight).
bool splitsBackward(ScheduleKind kind);

// One line per device: "0: F0 F1 B0 F2 B1 B2" (split: "0: F0 Bi0 W0"; chunks: "F0.1" is
// micro-batch 0's forward on chunk 1).
std::string formatSchedule(const Schedule& schedule);

}  // namespace rannc::partition
