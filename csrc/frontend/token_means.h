#pragma once
// Losses averaged over a count the data decides, made exact across micro-batches.
//
// [Note: token-mean losses] cross_entropy (and nll_loss) with reduction "mean" divides by
// the count of targets that are not ignore_index, each weighted by its class's weight when
// class weights are given: a language model's loss over padded or masked labels (-100) is
// a mean over the tokens that count, and a class-weighted loss a mean over the weights the
// labels draw; both counts differ between micro-batches and replicas. Weighting each
// share's mean by its rows, as scalar outputs are combined (DESIGN.md §1), gives what
// DistributedDataParallel and gradient accumulation give, not what one process gives on the
// global batch. So when the global batch is cut into several shares of such an op's stage,
// the op runs as
//     (its sum over the share's targets) / (global count * share rows / global rows)
// instead of its mean. The row-weighted combination of the shares (share rows / global
// rows) then gives
// exactly  (sum over all targets) / (global count), the loss of one process, and its
// gradients; other terms of the loss (an NSP loss added to an MLM loss) keep their row
// weighting. The global counts come before the step: the ops that make the target from the
// model's arguments (labels.view(-1), a shift by one token) run on each rank's own
// arguments, and one all-reduce sums the counts (PipelineEngine::step). A loss whose target
// depends on parameters, buffers, random draws or in-place writes keeps the row-weighted
// mean; `row_weighted` says why (rank 0 logs it).
//
// The ops have no batch size to tell the share's rows (a target's elements per row may vary,
// as a boolean selection's do), so the engine names them (ShareRows) around each stage's
// forward and backward.
//
// A mean written by hand, a sum over the batch divided by a count over its rows
// (`(loss * mask).sum() / mask.sum().clamp(min=1)`, `/ (labels != -100).sum()`; ir::batchCount),
// is made exact the same way: its division runs as
//     numerator / (global count * share rows / global rows).
// Only divisions whose value reaches the outputs as a
// term of them (ir::reachesOutputsLinearly) are changed: a count that normalises
// activations is the share's own, as in one process on that share.
//
// [Note: mixed terms] A scalar output may add terms that combine differently: a sum over the
// batch (reduction="sum", a sum over a count passed in, as transformers' num_items_in_batch)
// plus a mean (a router's auxiliary loss), or plus a term that is the same for any rows (a
// penalty on parameters, a constant). Summing each share's whole value counts the fixed
// term once per share and the mean as many times; weighting each by its rows shrinks the
// sum. So the output combines as a sum where one of its terms is a sum over the batch
// (ir::outputReduction), and the + or - that adds a term of another kind
// (ir::outputTerms) scales it by the share's rows (global rows = 1): the shares of a mean
// then add up to its row-weighted mean, those of a fixed term to the term, and a term
// whose reduction the graph does not show (a router's load-balancing loss, a product of
// means) is weighted by rows, as a whole output of that kind is (rank 0 logs it). Where
// an output combines as a mean (the option says so), a sum term is divided by the share's
// rows instead. As traced outside the engine's shares and where one share is the global
// batch.
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "frontend/traced_model.h"
#include "ir/reduction.h"

namespace rannc::frontend {

// What the wrapped op needs of the global batch; off: the op's own mean. Read by the op on
// the thread that runs the stage, set before each step.
struct ShareScale {
  bool on = false;
  double global_count = 0.0;  // the targets not ignored (a counted mean: its count, clamped)
  // With class weights: the global count of each class among the kept targets (float64, on
  // the stages' device); the op weighs them with its weight argument.
  at::Tensor global_class_counts;
};

struct TokenMeanLoss {
  ir::TaskId task = ir::kNoId;
  ir::ValueId target = ir::kNoId;  // for a counted mean, the tensor its count sums
  int64_t ignore_index = -100;
  int64_t classes = 0;  // with class weights, their number; 0 without
  // A mean written by hand: `task` is the division of a sum by this count.
  std::optional<ir::BatchCount> count;
  std::shared_ptr<ShareScale> scale;
};

// The rows of the share whose stage the calling thread runs, as a fraction of the global
// batch, while one lives (the engine's forward and backward of a stage); 0 outside.
class ShareRows {
 public:
  explicit ShareRows(double fraction);
  ~ShareRows();
  ShareRows(const ShareRows&) = delete;
  ShareRows& operator=(const ShareRows&) = delete;
  static double current();

 private:
  double previous_;
};

// A term of a scalar output whose reduction may differ from the output's ([Note: mixed
// terms]); the engine sets `power` once it knows how the output combines.
struct LossTerm {
  ir::ValueId output = ir::kNoId;
  ir::OutputTerm term;
  // The term is multiplied by (share rows / global rows) to this power: 1, -1, or 0 (as traced).
  std::shared_ptr<int> power;
};

struct TokenMeanLosses {
  std::vector<TokenMeanLoss> exact;
  std::vector<LossTerm> terms;
  // Terms whose reduction the graph does not show, of outputs whose other terms tell how
  // they combine: "term ... of output #0 (loss)".
  std::vector<std::string> unknown_terms;
  std::vector<ir::TaskId> program;  // the tasks that make their targets, in order
  // Values the program reads only the shape (and dtype) of ([Note: shapes read by counts]):
  // stand-ins of their shape at the rank's rows take their place.
  std::vector<ir::ValueId> shapes_read;
  // Mean losses over a count the data decides that stay weighted by rows: "op ... : why".
  std::vector<std::string> row_weighted;
};

// The token-mean losses of `model`, found and their operations wrapped on the first call
// (model.operations is mutable; copies made later, such as onDevice's, share the scales).
// Not thread-safe: call it before running the model on several threads.
const TokenMeanLosses& tokenMeanLosses(const TracedModel& model);

// "term 'name' (op at file:line)".
std::string describeTerm(const TracedModel& model, const ir::OutputTerm& term);

// Sets the power of each of `losses.terms` from whether its output is combined as a sum.
void setTermPowers(const TokenMeanLosses& losses, const std::set<ir::ValueId>& summed_outputs);

// Per loss of `losses.exact`, over this rank's arguments `local` (value id -> value): the
// count of its targets that are not ignored (a counted mean: its count before the clamp)
// and, with class weights, that count per class; all in one float64 tensor on the CPU, to
// be summed over the ranks.
at::Tensor localTargetCounts(const TracedModel& model, const TokenMeanLosses& losses,
                             const std::map<ir::ValueId, c10::IValue>& local);

// Sets each loss's scale from the sum of every rank's localTargetCounts (nullptr: off, the
// ops' own means); class counts go to `device`, where the stages run.
void setShareScales(const TokenMeanLosses& losses, const at::Tensor* global_counts,
                    c10::Device device = c10::kCPU);

}  // namespace rannc::frontend
