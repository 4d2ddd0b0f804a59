#pragma once
// One step of one rank as typed actions: the schedule's forwards and backwards lowered
// together with the transfers around them and the gradient all-reduce, in the order the
// engine runs them. Pure (no torch): built from the schedule and the transfer plan, printed
// for people, checked by GoogleTest; runtime/engine.h executes it.
//
// [Note: step order] The receives an action needs are posted one compute action ahead, so
// their data arrive while the previous action computes ([Note: progress thread] in
// comm/world.h); sends are posted right after the compute that produced them and waited
// for at the end of the step. The gradient all-reduce is armed before the step's last
// backward: its buckets start as their gradients become final (runtime/grad_buckets.h).
#include <set>
#include <string>
#include <vector>

#include "partition/sim/schedule.h"
#include "runtime/transfers.h"

namespace rannc::runtime {

enum class StepActionKind {
  SendInputRows,   // rows of this rank's arguments to the ranks that run them
  Receive,         // post the receives of the next compute action
  Forward,
  Backward,
  BackwardInput,   // a split backward's input part ([Note: split backward] in frontend/split_backward.h)
  BackwardWeight,  // its weight part: no transfers
  Send,            // post the sends of what the compute action just produced
  ArmAllReduce,    // before the last backward (or weight part): all-reduce buckets as gradients finish
  CollectOutputs,  // this rank's rows of the batch outputs
  Finish,          // wait for the sends; finish the all-reduce and the inputs' gradients
};
const char* stepActionName(StepActionKind kind);

// A transfer and the channel it goes over; `local` when source and destination are this
// rank: nothing moves, the rows are taken from this rank's own tensor (an argument), or
// from the output or input gradient of another of its stages (interleaved schedules).
struct ChannelTransfer {
  Channel channel = Channel::Activation;
  Transfer transfer;
  bool local = false;
};

struct StepAction {
  StepActionKind kind = StepActionKind::Forward;
  int micro_batch = -1;
  int chunk = 0;  // compute, Receive and Send: which of the rank's stages (interleaved schedules)
  // Receive: whether it feeds a forward (inputs) or a backward (outputs' gradients).
  partition::ActionKind feeds = partition::ActionKind::Forward;
  // Receive, Send, SendInputRows: the transfers, grouped by value id ascending, each in
  // channel order. A backward's Send lists the pieces of every input gradient; the engine
  // sends zeros for an input that got none.
  std::vector<ChannelTransfer> transfers;

  std::string str() const;  // "F3", "recv F3: activation v12 m3 rows [0, 4) 1->2 ..."
};

struct StepProgram {
  std::vector<StepAction> actions;
  std::string str() const;  // one action per line
};

// What the lowering needs of this rank's stage.
struct StageBoundary {
  std::vector<ir::ValueId> input_ids;   // the executor's inputs, in call order
  std::vector<ir::ValueId> output_ids;  // its outputs
};

// Lowers `compute` (this rank's forwards and backwards, in order: the planned schedule, or
// the forwards or backwards of a fill-drain step, or forwards only) into a step.
// `input_grads`: the model arguments whose gradients the user wants (their rows go back to
// their owners); `all_reduce`: this rank shares gradients with others (arm before the last
// backward).
StepProgram lowerStep(const std::vector<partition::Action>& compute, const TransferPlan& plan,
                      const ir::Graph& graph, const StageBoundary& stage,
                      const std::set<ir::ValueId>& input_grads, bool all_reduce);

// The same for a rank holding several stages (chunks of an interleaved schedule): chunk c
// of an action runs stage `stages[c]` with the transfers of `plans[c]` (planTransfers for
// that stage; the rank's argument rows come with chunk 0's).
StepProgram lowerStep(const std::vector<partition::Action>& compute, const std::vector<const TransferPlan*>& plans,
                      const ir::Graph& graph, const std::vector<StageBoundary>& stages,
                      const std::set<ir::ValueId>& input_grads, bool all_reduce);

// The step action that runs a schedule action.
StepActionKind computeKind(partition::ActionKind kind);

// Whether a value of the boundary carries a gradient back (a tensor that requires grad).
bool carriesGradient(const ir::Value& value);

}  // namespace rannc::runtime
