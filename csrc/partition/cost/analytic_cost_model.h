#pragma once
// A cost model from shapes alone: FLOPs for matmul-like ops (linear, matmul, conv,
// attention), bytes moved for the rest, each against the device's peak; views and size
// arithmetic are free (no kernel, no stash). Good enough to
// plan without a device (dry runs, tests, benchmarks); the profiler replaces it on GPUs.
#include <vector>

#include "partition/cost/cost_model.h"

namespace rannc::partition {

class AnalyticCostModel : public CostModel {
 public:
  // Precomputes per-task FLOPs and bytes of `graph` (which must outlive the model).
  // `cache_by_content`: also key the cache by ir::contentHash (off by default: hashing a
  // piece costs more than this model's own arithmetic).
  AnalyticCostModel(const ir::Graph& graph, DeviceSpec device, bool cache_by_content = false);

  // FLOPs of one task's forward at the traced batch size.
  double taskFlops(ir::TaskId task) const { return tasks_[task].flops; }

 protected:
  PieceCost computeCost(const ir::Subgraph& piece, int64_t rows) override;
  bool computeCostDirect(const std::vector<ir::TaskId>& tasks, int64_t rows, PieceCost* out) override;
  bool cacheByContent() const override { return cache_by_content_; }

 private:
  struct TaskCost {
    double flops = 0.0;        // at the traced batch size
    bool flops_scale = false;  // FLOPs grow with the rows (some output carries the batch)
    double batch_bytes = 0.0;  // bytes read and written that scale with rows (at traced size)
    double fixed_bytes = 0.0;  // bytes read and written that do not
    bool free = false;         // a view or size arithmetic: no time, nothing stashed
    // backward time per forward time: the gradients of the inputs and of the weights, one
    // product each; a task whose parameters are all frozen computes the first alone, or
    // nothing where no other input takes a gradient ([Note: frozen parameters' memory])
    double backward_factor = 2.0;
  };
  double forwardTime(const TaskCost& t, double scale) const;

  // What the direct path reads of each value, flat (valueBytesAt without the lookups).
  struct ValueInfo {
    ir::TaskId producer = ir::kNoId;
    ir::ValueRole role = ir::ValueRole::Intermediate;
    bool tensor = false;
    bool batch = false;  // bytes scale with the rows
    int64_t bytes = 0;   // at the traced batch size
    bool requires_grad = false;
  };

  std::vector<TaskCost> tasks_;
  std::vector<ValueInfo> values_;
  bool cache_by_content_;
  // Scratch marks for the direct path (membership of tasks, values already counted).
  std::vector<int> in_piece_, value_seen_;
  std::vector<char> graph_output_;
  int stamp_ = 0;
};

}  // namespace rannc::partition
