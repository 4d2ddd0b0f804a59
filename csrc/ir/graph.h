#pragma once
// The dataflow graph of a traced model: values, tasks, ordered inputs and outputs.
// Tasks are added in a topological order (the trace order); the graph keeps the
// producer/consumer edges and answers structural questions. No torch here.
#include <cstdint>
#include <string>
#include <vector>

#include "ir/task.h"
#include "ir/value.h"

namespace rannc::ir {

class Graph {
 public:
  // Adds a value and returns its id; the id field of `value` is overwritten.
  ValueId addValue(Value value);
  // Adds a task over existing values; its outputs must not have a producer yet.
  // Throws InvalidGraphError on unknown ids or a second producer.
  TaskId addTask(std::string op, std::vector<ValueId> inputs, std::vector<ValueId> outputs,
                 std::string scope = {}, std::string source = {});

  void setInputs(std::vector<ValueId> inputs);
  void setOutputs(std::vector<ValueId> outputs);
  void setBatchSize(int64_t batch_size) { batch_size_ = batch_size; }

  const Value& value(ValueId id) const;
  Value& mutableValue(ValueId id);
  const Task& task(TaskId id) const;
  const std::vector<Value>& values() const { return values_; }
  const std::vector<Task>& tasks() const { return tasks_; }
  const std::vector<ValueId>& inputs() const { return inputs_; }
  const std::vector<ValueId>& outputs() const { return outputs_; }
  int64_t batchSize() const { return batch_size_; }
  int numTasks() const { return static_cast<int>(tasks_.size()); }
  int numValues() const { return static_cast<int>(values_.size()); }

  // Tasks in a topological order (Kahn's algorithm, ties broken by id, so stable).
  // Throws InvalidGraphError if the graph has a cycle.
  std::vector<TaskId> topologicalOrder() const;

  // Checks ids, edges and acyclicity; throws InvalidGraphError naming what is wrong.
  void validate() const;

  // Stable content hash: operators, edges, types, shapes, batch flags, constants and
  // (when include_names) the names of inputs, parameters and buffers. Independent of
  // ids, scopes, source locations and the process.
  uint64_t contentHash(bool include_names = true) const;

  // Counts and sizes for people: tasks, values, inputs, parameters, batch values.
  std::string summary() const;

 private:
  void checkValueId(ValueId id, const char* what) const;

  std::vector<Value> values_;
  std::vector<Task> tasks_;
  std::vector<ValueId> inputs_;
  std::vector<ValueId> outputs_;
  int64_t batch_size_ = 0;
};

}  // namespace rannc::ir
