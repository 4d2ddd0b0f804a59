#pragma once
// Realistic inputs for running one piece on its own at any micro-batch size.
//
// The graph is run once at the example batch (no grad); from that run we keep the values
// that must stay meaningful: the model's tensor arguments, every integer and boolean
// tensor (token ids, masks, index tensors stay in range) and every non-tensor value.
// Floating-point intermediates are drawn at random (their values do not change the
// time of dense ops), with the batch dimension scaled to the requested rows. Kept values
// with a batch dimension are cycled over their rows; sizes and shapes that scale with
// the batch are recomputed for the rows ([Note: shape values] in ir/value.h).
#include <cstdint>
#include <memory>
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

 private:
  c10::IValue build(const ir::Value& value, int64_t rows) const;

  std::shared_ptr<const frontend::TracedModel> model_;
  std::unordered_map<ir::ValueId, c10::IValue> kept_;
};

// Rows `rows` of `t` along `dim` where `t` has `multiple * batch` rows there: row i is
// row i mod (multiple * batch) (cycled), so indices and masks stay valid.
at::Tensor cycleRows(const at::Tensor& t, int64_t dim, int64_t target_rows);

}  // namespace rannc::profile
