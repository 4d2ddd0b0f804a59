#include "runtime/step_program.h"

#include <algorithm>
#include <sstream>

#include "common/error.h"

namespace rannc::runtime {

const char* stepActionName(StepActionKind kind) {
  switch (kind) {
    case StepActionKind::SendInputRows: return "send-input-rows";
    case StepActionKind::Receive: return "recv";
    case StepActionKind::Forward: return "F";
    case StepActionKind::Backward: return "B";
    case StepActionKind::BackwardInput: return "Bi";
    case StepActionKind::BackwardWeight: return "W";
    case StepActionKind::Send: return "send";
    case StepActionKind::ArmAllReduce: return "arm-allreduce";
    case StepActionKind::CollectOutputs: return "collect-outputs";
    case StepActionKind::Finish: return "finish";
  }
  return "?";
}

std::string StepAction::str() const {
  std::ostringstream os;
  const char* compute = partition::actionName(feeds);
  switch (kind) {
    case StepActionKind::Forward:
    case StepActionKind::Backward:
    case StepActionKind::BackwardInput:
    case StepActionKind::BackwardWeight:
      return stepActionName(kind) + std::to_string(micro_batch) + (chunk ? "." + std::to_string(chunk) : "");
    case StepActionKind::Receive:
      os << "recv " << compute << micro_batch << (chunk ? "." + std::to_string(chunk) : "") << ":";
      break;
    case StepActionKind::Send:
      os << "send " << compute << micro_batch << (chunk ? "." + std::to_string(chunk) : "") << ":";
      break;
    default:
      os << stepActionName(kind);
      if (transfers.empty()) return os.str();
      os << ":";
  }
  for (const auto& t : transfers) {
    os << " " << channelName(t.channel) << (t.local ? "(local) " : " ") << t.transfer.str() << ";";
  }
  return os.str();
}

std::string StepProgram::str() const {
  std::ostringstream os;
  for (const auto& a : actions) os << a.str() << "\n";
  return os.str();
}

bool carriesGradient(const ir::Value& value) { return value.isTensor() && value.requires_grad; }

StepActionKind computeKind(partition::ActionKind kind) {
  switch (kind) {
    case partition::ActionKind::Forward: return StepActionKind::Forward;
    case partition::ActionKind::Backward: return StepActionKind::Backward;
    case partition::ActionKind::BackwardInput: return StepActionKind::BackwardInput;
    case partition::ActionKind::BackwardWeight: return StepActionKind::BackwardWeight;
  }
  return StepActionKind::Forward;
}

namespace {

class Lowering {
 public:
  Lowering(const TransferPlan& plan, const ir::Graph& graph, const StageBoundary& stage,
           const std::set<ir::ValueId>& input_grads)
      : plan_(plan), graph_(graph), input_grads_(input_grads),
        graph_inputs_(graph.inputs().begin(), graph.inputs().end()),
        inputs_by_id_(stage.input_ids), outputs_by_id_(stage.output_ids) {
    std::sort(inputs_by_id_.begin(), inputs_by_id_.end());
    std::sort(outputs_by_id_.begin(), outputs_by_id_.end());
  }

  StepAction receive(const partition::Action& a) const {
    StepAction r{StepActionKind::Receive, a.micro_batch, a.chunk, a.kind, {}};
    const int m = a.micro_batch;
    if (a.kind == partition::ActionKind::Forward) {
      for (ir::ValueId vid : inputs_by_id_) {
        if (isShapeValue(graph_.value(vid))) continue;
        const auto& list = find(plan_.recv.at(m), vid);
        RANNC_CHECK(!list.empty(), "rank " << plan_.rank << ": no source for input " << vid
                                           << " of micro-batch " << m);
        Channel ch = graph_inputs_.count(vid) ? Channel::InputRows : Channel::Activation;
        for (const Transfer& t : list) r.transfers.push_back({ch, t, t.src == plan_.rank});
      }
    } else {
      for (ir::ValueId vid : outputs_by_id_) {
        if (!carriesGradient(graph_.value(vid))) continue;
        // The gradient of each piece sent comes back from its consumer (from this rank's
        // later stage's backward where the consumer is here: local).
        for (const Transfer& t : find(plan_.send.at(m), vid)) {
          r.transfers.push_back({Channel::Gradient, t, t.dst == plan_.rank});
        }
      }
    }
    return r;
  }

  StepAction send(const partition::Action& a) const {
    StepAction s{StepActionKind::Send, a.micro_batch, a.chunk, a.kind, {}};
    const int m = a.micro_batch;
    if (a.kind == partition::ActionKind::Forward) {
      for (const auto& [vid, list] : plan_.send.at(m)) {
        // a later stage of this rank reads the output where it is
        for (const Transfer& t : list) {
          if (t.dst != plan_.rank) s.transfers.push_back({Channel::Activation, t, false});
        }
      }
      for (const auto& [vid, list] : plan_.out_send.at(m)) {
        // this rank's own rows of a batch output are collected, not sent
        for (const Transfer& t : list) {
          if (t.dst != plan_.rank) s.transfers.push_back({Channel::BatchOutput, t, false});
        }
      }
      return s;
    }
    for (ir::ValueId vid : inputs_by_id_) {
      const ir::Value& v = graph_.value(vid);
      if (graph_inputs_.count(vid)) {
        if (!input_grads_.count(vid)) continue;
        // [Note: input gradients] in engine.h: whole values are summed locally, then over ranks
        for (const Transfer& t : find(plan_.recv.at(m), vid)) {
          s.transfers.push_back({Channel::InputGradient, t, t.whole || t.src == plan_.rank});
        }
        continue;
      }
      if (!carriesGradient(v) || isShapeValue(v)) continue;
      for (const Transfer& t : find(plan_.recv.at(m), vid)) {
        s.transfers.push_back({Channel::Gradient, t, t.src == plan_.rank});
      }
    }
    return s;
  }

 private:
  static const std::vector<Transfer>& find(const TransfersByValue& table, ir::ValueId vid) {
    static const std::vector<Transfer> none;
    auto it = table.find(vid);
    return it == table.end() ? none : it->second;
  }

  const TransferPlan& plan_;
  const ir::Graph& graph_;
  const std::set<ir::ValueId>& input_grads_;
  std::set<ir::ValueId> graph_inputs_;
  std::vector<ir::ValueId> inputs_by_id_;
  std::vector<ir::ValueId> outputs_by_id_;
};

}  // namespace

StepProgram lowerStep(const std::vector<partition::Action>& compute, const TransferPlan& plan,
                      const ir::Graph& graph, const StageBoundary& stage,
                      const std::set<ir::ValueId>& input_grads, bool all_reduce) {
  return lowerStep(compute, std::vector<const TransferPlan*>{&plan}, graph, std::vector<StageBoundary>{stage},
                   input_grads, all_reduce);
}

StepProgram lowerStep(const std::vector<partition::Action>& compute, const std::vector<const TransferPlan*>& plans,
                      const ir::Graph& graph, const std::vector<StageBoundary>& stages,
                      const std::set<ir::ValueId>& input_grads, bool all_reduce) {
  RANNC_CHECK(!plans.empty() && plans.size() == stages.size(),
              plans.size() << " transfer plans for " << stages.size() << " stages");
  std::vector<Lowering> chunks;
  chunks.reserve(plans.size());
  for (size_t c = 0; c < plans.size(); ++c) chunks.emplace_back(*plans[c], graph, stages[c], input_grads);
  auto lowering = [&](const partition::Action& a) -> const Lowering& {
    RANNC_CHECK(a.chunk >= 0 && a.chunk < static_cast<int>(chunks.size()),
                "action on chunk " << a.chunk << " of a rank with " << chunks.size());
    return chunks[a.chunk];
  };
  const TransferPlan& plan = *plans.front();
  StepProgram program;
  auto& out = program.actions;
  bool has_forwards = std::any_of(compute.begin(), compute.end(), [](const partition::Action& a) {
    return a.kind == partition::ActionKind::Forward;
  });
  // The gradients are final after the last backward, or its weight part when split.
  int last_backward = -1;
  for (size_t i = 0; i < compute.size(); ++i) {
    if (compute[i].kind == partition::ActionKind::Backward ||
        compute[i].kind == partition::ActionKind::BackwardWeight) {
      last_backward = static_cast<int>(i);
    }
  }
  if (has_forwards && !plan.input_sends.empty()) {
    StepAction a{StepActionKind::SendInputRows, -1, 0, partition::ActionKind::Forward, {}};
    for (const Transfer& t : plan.input_sends) a.transfers.push_back({Channel::InputRows, t, false});
    out.push_back(std::move(a));
  }
  // A weight part neither receives nor sends; the receives of the next action that does
  // are posted one compute action ahead of it.
  auto transfers = [&](size_t i) { return compute[i].kind != partition::ActionKind::BackwardWeight; };
  size_t posted = 0;  // receives are posted for the transferring actions before this index
  auto postFirstFrom = [&](size_t from) {
    size_t j = from;
    while (j < compute.size() && !transfers(j)) ++j;
    if (j < compute.size() && j >= posted) {
      out.push_back(lowering(compute[j]).receive(compute[j]));
      posted = j + 1;
    }
  };
  postFirstFrom(0);
  for (size_t i = 0; i < compute.size(); ++i) {
    const auto& a = compute[i];
    if (static_cast<int>(i) == last_backward && all_reduce) {
      out.push_back(StepAction{StepActionKind::ArmAllReduce, -1, 0, partition::ActionKind::Backward, {}});
    }
    postFirstFrom(i + 1);
    out.push_back(StepAction{computeKind(a.kind), a.micro_batch, a.chunk, a.kind, {}});
    if (transfers(i)) out.push_back(lowering(a).send(a));
  }
  if (has_forwards) out.push_back(StepAction{StepActionKind::CollectOutputs, -1, 0, partition::ActionKind::Forward, {}});
  out.push_back(StepAction{StepActionKind::Finish, -1, 0, partition::ActionKind::Forward, {}});
  return program;
}

}  // namespace rannc::runtime
