#include "ir/graph.h"

#include <algorithm>
#include <functional>
#include <map>
#include <queue>
#include <sstream>

#include "common/error.h"
#include "common/hash.h"
#include "ir/subgraph.h"

namespace rannc::ir {

ValueId Graph::addValue(Value value) {
  value.id = static_cast<ValueId>(values_.size());
  value.producer = kNoId;
  value.consumers.clear();
  values_.push_back(std::move(value));
  return values_.back().id;
}

void Graph::checkValueId(ValueId id, const char* what) const {
  if (id < 0 || id >= static_cast<ValueId>(values_.size())) {
    throw InvalidGraphError(std::string("unknown value id ") + std::to_string(id) + " used as " +
                            what);
  }
}

TaskId Graph::addTask(std::string op, std::vector<ValueId> inputs, std::vector<ValueId> outputs,
                      std::string scope, std::string source) {
  const TaskId id = static_cast<TaskId>(tasks_.size());
  for (ValueId v : inputs) checkValueId(v, ("input of " + op).c_str());
  for (ValueId v : outputs) {
    checkValueId(v, ("output of " + op).c_str());
    if (values_[v].producer != kNoId) {
      throw InvalidGraphError("value " + describe(values_[v]) + " has two producers: task " +
                              std::to_string(values_[v].producer) + " and " + op);
    }
  }
  for (ValueId v : inputs) {
    auto& cons = values_[v].consumers;
    if (std::find(cons.begin(), cons.end(), id) == cons.end()) cons.push_back(id);
  }
  for (ValueId v : outputs) values_[v].producer = id;
  tasks_.push_back(Task{id, std::move(op), std::move(inputs), std::move(outputs), std::move(scope),
                        std::move(source)});
  return id;
}

void Graph::setInputs(std::vector<ValueId> inputs) {
  for (ValueId v : inputs) checkValueId(v, "graph input");
  inputs_ = std::move(inputs);
}

void Graph::setOutputs(std::vector<ValueId> outputs) {
  for (ValueId v : outputs) checkValueId(v, "graph output");
  outputs_ = std::move(outputs);
}

const Value& Graph::value(ValueId id) const {
  checkValueId(id, "lookup");
  return values_[id];
}

Value& Graph::mutableValue(ValueId id) {
  checkValueId(id, "lookup");
  return values_[id];
}

const Task& Graph::task(TaskId id) const {
  if (id < 0 || id >= static_cast<TaskId>(tasks_.size())) {
    throw InvalidGraphError("unknown task id " + std::to_string(id));
  }
  return tasks_[id];
}

std::vector<TaskId> Graph::topologicalOrder() const {
  std::vector<int> indegree(tasks_.size(), 0);
  for (const Task& t : tasks_) {
    for (ValueId v : t.inputs) {
      if (values_[v].producer != kNoId) ++indegree[t.id];
    }
  }
  std::priority_queue<TaskId, std::vector<TaskId>, std::greater<>> ready;
  for (const Task& t : tasks_) {
    if (indegree[t.id] == 0) ready.push(t.id);
  }
  std::vector<TaskId> order;
  order.reserve(tasks_.size());
  while (!ready.empty()) {
    TaskId t = ready.top();
    ready.pop();
    order.push_back(t);
    for (ValueId v : tasks_[t].outputs) {
      for (TaskId c : values_[v].consumers) {
        // A consumer may read the same value several times; it counted each edge once
        // per input slot, so release one per slot.
        for (ValueId in : tasks_[c].inputs) {
          if (in == v && --indegree[c] == 0) ready.push(c);
        }
      }
    }
  }
  if (order.size() != tasks_.size()) {
    throw InvalidGraphError("graph has a cycle: " + std::to_string(tasks_.size() - order.size()) +
                            " tasks never become ready");
  }
  return order;
}

void Graph::validate() const {
  for (const Value& v : values_) {
    if (v.producer != kNoId) {
      const Task& p = task(v.producer);
      if (std::find(p.outputs.begin(), p.outputs.end(), v.id) == p.outputs.end()) {
        throw InvalidGraphError("value " + describe(v) + " names task " +
                                std::to_string(p.id) + " as producer, which does not output it");
      }
    } else if (v.role == ValueRole::Intermediate && !v.consumers.empty()) {
      throw InvalidGraphError("intermediate value " + describe(v) + " has no producer");
    }
    for (TaskId c : v.consumers) {
      const Task& t = task(c);
      if (std::find(t.inputs.begin(), t.inputs.end(), v.id) == t.inputs.end()) {
        throw InvalidGraphError("value " + describe(v) + " lists consumer " + std::to_string(c) +
                                " (" + t.op + "), which does not read it");
      }
    }
  }
  for (const Task& t : tasks_) {
    for (ValueId v : t.inputs) checkValueId(v, "task input");
    for (ValueId v : t.outputs) {
      checkValueId(v, "task output");
      if (values_[v].producer != t.id) {
        throw InvalidGraphError("task " + std::to_string(t.id) + " (" + t.op + ") outputs " +
                                describe(values_[v]) + " but is not its producer");
      }
    }
  }
  topologicalOrder();
}

uint64_t Graph::contentHash(bool include_names) const {
  Subgraph all;
  all.tasks = topologicalOrder();
  all.outputs = outputs_;
  // Hash through the same canonical encoding as a piece, plus the input order.
  Fnv1a h;
  h.u64(::rannc::ir::contentHash(*this, all));
  h.u64(inputs_.size());
  for (ValueId v : inputs_) {
    const Value& val = values_[v];
    h.u64(static_cast<uint64_t>(val.role));
    if (include_names) h.str(val.name);
  }
  if (include_names) {
    for (const Value& val : values_) {
      if (val.isModelState()) h.str(val.name);
    }
  }
  return h.digest();
}

std::string Graph::summary() const {
  int64_t param_bytes = 0, buffer_bytes = 0, batch_values = 0;
  int params = 0, buffers = 0, constants = 0, batch_inputs = 0;
  std::map<std::string, int> ops;
  for (const Value& v : values_) {
    if (v.role == ValueRole::Param) ++params, param_bytes += v.bytes();
    if (v.role == ValueRole::Buffer) ++buffers, buffer_bytes += v.bytes();
    if (v.role == ValueRole::Constant) ++constants;
    if (v.isBatch()) ++batch_values;
  }
  for (ValueId v : inputs_) {
    if (values_[v].role == ValueRole::Input && values_[v].isBatch()) ++batch_inputs;
  }
  for (const Task& t : tasks_) ++ops[t.op];
  int user_inputs = 0;
  for (ValueId v : inputs_) user_inputs += values_[v].role == ValueRole::Input;

  std::ostringstream os;
  os << "Graph: " << tasks_.size() << " tasks, " << values_.size() << " values, batch size "
     << batch_size_ << ", hash " << std::hex << contentHash() << std::dec << "\n";
  os << "  inputs: " << user_inputs << " (" << batch_inputs << " with batch dimension)\n";
  os << "  parameters: " << params << " (" << param_bytes << " bytes), buffers: " << buffers
     << " (" << buffer_bytes << " bytes), constants: " << constants << "\n";
  os << "  batch values: " << batch_values << "\n";
  os << "  outputs:";
  for (ValueId v : outputs_) os << " " << describe(values_[v]) << ";";
  os << "\n  ops:";
  std::vector<std::pair<int, std::string>> by_count;
  for (auto& [op, n] : ops) by_count.emplace_back(-n, op);
  std::sort(by_count.begin(), by_count.end());
  for (size_t i = 0; i < by_count.size(); ++i) {
    if (i == 12) {
      os << " ... (" << by_count.size() - i << " more)";
      break;
    }
    os << " " << by_count[i].second << " x" << -by_count[i].first;
  }
  os << "\n";
  return os.str();
}

}  // namespace rannc::ir
