#pragma once
// Realistic inputs for running one piece on its own at any micro-batch size.
//
// [Note: data values] A piece's inputs are of two sorts. Activations (floating tensors
// that require grad) only need the right shape: their values do not change the time of
// dense ops, so they are drawn at random (uniform in [0, 1), which ops on probabilities
// accept), the batch dimension scaled to the rows. Every
// other value is data whose content matters: token ids, masks, index tensors, position
// buckets computed in floating point (T5), additive masks, rotary tables, sizes. An
// index invented or cut from another batch size can point outside what it indexes (a
// crash on the CPU, a device-side assert on a GPU). So data values are computed as the
// model computes them at that row count: the "data pass" runs, at `rows` rows, only the
// tasks that produce data, on the model's arguments with their rows cycled to `rows`;
// where such a task reads an activation (its size, say) it gets a zero-cost placeholder
// of the activation's shape. A data value the pass cannot compute (its task fails on a
// placeholder) falls back to the value at the example batch with its rows cycled, and
// sizes that scale with the batch are recomputed ([Note: shape values] in ir/value.h).
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

#include "frontend/traced_model.h"
#include "ir/subgraph.h"

namespace rannc::profile {

class BoundaryInputs {
 public:
  // `example` follows model->graph.inputs() (parameters, buffers, then the arguments) at
  // the traced batch size. Runs the graph once (no grad, RNG state restored). Throws
  // rannc::Error when the graph fails on the example.
  BoundaryInputs(std::shared_ptr<const frontend::TracedModel> model,
                 const std::vector<at::Tensor>& example);

  // The inputs of `piece` in frontend::runPieceInputs order at a micro-batch of `rows`
  // rows. Parameters and buffers are the model's tensors, detached (gradients of a
  // profiling run never reach the model). Floating tensors require grad where the value
  // does (the piece's boundary leaves). Throws rannc::Error for a value it cannot build.
  std::vector<c10::IValue> make(const ir::Subgraph& piece, int64_t rows) const;

  // The tensor of a parameter or buffer (shared storage with the model).
  const at::Tensor& state(ir::ValueId id) const { return kept_.at(id).toTensor(); }

  // Whether `v` is data ([Note: data values]): anything but a floating tensor (or a
  // container of them) that requires grad.
  static bool isData(const ir::Value& v);

  // The data values computed at `rows` rows by the data pass (absent: not computable).
  using DataValues = std::unordered_map<ir::ValueId, c10::IValue>;
  std::shared_ptr<const DataValues> dataAt(int64_t rows) const;

 private:
  c10::IValue build(const ir::Value& value, int64_t rows) const;
  std::shared_ptr<const DataValues> runDataPass(int64_t rows) const;

  std::shared_ptr<const frontend::TracedModel> model_;
  std::unordered_map<ir::ValueId, c10::IValue> kept_;
  std::vector<ir::TaskId> data_tasks_;  // tasks with a data output, in topological order
  c10::Device home_{c10::kCPU};         // where the example tensors are

  // The data passes of the last few row counts (profiling asks for one count at a time).
  mutable std::mutex mutex_;
  mutable std::list<std::pair<int64_t, std::shared_ptr<const DataValues>>> passes_;
};

// Rows `rows` of `t` along `dim` where `t` has `multiple * batch` rows there: row i is
// row i mod (multiple * batch) (cycled), so indices and masks stay valid.
at::Tensor cycleRows(const at::Tensor& t, int64_t dim, int64_t target_rows);

}  // namespace rannc::profile
