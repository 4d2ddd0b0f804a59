#pragma once
// The pipeline engine: runs this rank's stage of a deployment for one step, in one call
// (its stages: one per chunk under an interleaved schedule, [Note: chunks on a rank]).
// It lowers the planned schedule (partition/sim/schedule.h, the lists the simulator ran)
// with the transfer plan (transfers.h) into typed actions (step_program.h) and executes
// them over the channels (channels.h) and the stage executor (stage.h), with the bucketed
// gradient all-reduce (grad_buckets.h) overlapped with the last backward.
//
// [Note: batch sizes] The plan's stages and replicas hold for any batch; what depends on
// the batch size (the rows of each micro-batch and replica, the micro-batch count, the
// transfer plan, the channels and the step programs) is built per local batch size and
// cached. A batch smaller than the plan's runs fewer micro-batches when its rows do not
// fill them all.
//
// [Note: input gradients] An argument whose tensor requires grad gets its gradient, as in
// PyTorch: each replica's backward returns the gradient of the rows it received, and sends
// each row range back to the rank that owns it (the reverse of the input rows' transfer,
// over MPI like them). A tensor without a batch dimension (every rank passes its own copy)
// gets the sum over all ranks' rows, as the concatenated batch would. An argument that
// carries the batch gets W times (W ranks) its rows of the global batch's gradient: for a
// loss that is a mean over the rows, DistributedDataParallel's, the gradient of this rank's
// loss over its own rows. So modules compose: a fill-drain module divides the gradients
// of its outputs by W (the user's loss over this rank's rows is W times its share of the
// global mean, as under DDP), and a module whose output feeds another (a GAN's generator
// and discriminator) gets through the other's input gradients, and any loss the user adds
// on its rows, gradients of that same scale; with the global batch's rows only, the
// generator of a 2-rank GAN trained at half its gradient.
//
// [Note: chunks on a rank] Under an interleaved schedule a rank runs several stages (its
// chunks: stage c x G + g of the G device groups is chunk c of group g's ranks, which hold
// the same copy and replica of each). Each chunk has its own executor and transfer plan;
// the step program names the chunk of every action. A value passed between two chunks of
// the rank is never sent: the consumer reads the producer's output of that micro-batch,
// and the producer's backward reads the gradient the consumer's backward returned.
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "frontend/token_means.h"
#include "partition/plan.h"
#include "runtime/batch_memory.h"
#include "runtime/channels.h"
#include "runtime/grad_buckets.h"
#include "runtime/layout.h"
#include "runtime/stage.h"
#include "runtime/step_program.h"
#include "runtime/transfers.h"

namespace rannc::runtime {

// A gradient seed of a stage output for one micro-batch: `tensor` where defined, else
// `value` filled to the output's shape and dtype.
struct Seed {
  double value = 0.0;
  at::Tensor tensor;
};
using Seeds = std::map<int, std::map<ir::ValueId, Seed>>;

struct StepOutputs {
  // Per micro-batch, the model outputs this rank's stage produced.
  std::map<int, std::map<ir::ValueId, c10::IValue>> produced;
  // This rank's own rows of each batch output, in row order.
  std::map<ir::ValueId, at::Tensor> batch_outputs;
};

// One step's gradients of the engine's ownParameters(), in its order.
struct StepGrads {
  std::vector<at::Tensor> tensors;
};

// Where one step's time went on this rank (seconds): for bench/pipeline_breakdown.py.
struct StepTimes {
  double forward = 0.0;
  double backward = 0.0;
  double wait = 0.0;  // waiting for receives, sends and the all-reduce
  double total = 0.0;
};

enum class StepMode { Train, Eval, FillDrainForward, FillDrainBackward };

class PipelineEngine {
 public:
  // `state`: value id -> the module's tensor (this rank's stage's ones on `device`); `nccl`:
  // CUDA stages talk over NCCL (else MPI, through host memory for CUDA tensors). Collective:
  // creates the gradient groups' communicators.
  PipelineEngine(std::shared_ptr<const frontend::TracedModel> model, partition::Deployment deployment,
                 int rank, int world_size, int64_t local_batch,
                 const std::unordered_map<ir::ValueId, at::Tensor>& state,
                 c10::Device device, bool nccl, int64_t bucket_bytes = 4 << 20);

  const partition::Deployment& deployment() const { return deployment_; }
  const Layout& layout() const { return config_->layout; }
  // Where the rank sits (its first chunk's stage; copy and replica hold for every chunk).
  const Place& place() const { return chunks_.front().place; }
  // The stages this rank runs, one per chunk, ascending.
  std::vector<int> stages() const;
  const std::vector<ir::Subgraph>& pieces() const { return pieces_; }
  StageExecutor& executor(int chunk = 0) { return *chunks_.at(chunk).executor; }
  // Stage producing `value` (-1 for none: a model argument, a constant).
  int producerOf(ir::ValueId value) const;
  // The factor of micro-batch `m`'s value of scalar output `value` (made by a stage of this
  // rank) in the output over the global batch, its seed's factor too: the share's fraction
  // of the global rows (a mean over the batch), or 1 for a summed output.
  double shareWeight(ir::ValueId value, int m) const;
  ir::ValueId lossId() const { return loss_id_; }
  // Its stage's parameters and buffers (value id -> the module's tensor).
  const std::map<ir::ValueId, at::Tensor>& stageState() const { return stage_state_; }
  // The parameters this rank updates (its stage's state that requires grad).
  const std::map<ir::ValueId, at::Tensor>& ownParameters() const { return own_; }
  // Batch outputs this rank receives rows of (see StepOutputs::batch_outputs).
  std::vector<ir::ValueId> batchOutputIds() const;
  // (ranks, parameter ids) sharing gradients, for every parameter of every stage.
  std::vector<std::pair<std::vector<int>, std::vector<ir::ValueId>>> gradientGroups() const;

  // Runs the next steps on local batches of `local_batch` rows (every rank calls it with the
  // same size). Returns true when this size is new.
  bool useBatch(int64_t local_batch);
  // The predicted peak of the current batch size's micro-batch count against the plan's
  // memory limit ([Note: memory at other batches]).
  const MicroBatchFit& memoryFit() const { return config_->memory; }
  // The model arguments whose tensors require grad in the next steps.
  void setInputGrads(std::set<ir::ValueId> ids);
  // Scalar outputs that are sums over the batch (ir/reduction.h, option loss_reduction): the
  // loss among them seeds each micro-batch with the whole loss scale instead of its rows'
  // share of it. Terms of another kind in them are scaled to match ([Note: mixed terms]).
  void setSummedOutputs(std::set<ir::ValueId> ids);

  // One step: with `train`, the planned schedule seeded by the scalar loss (its share of
  // each micro-batch, times `loss_scale`: a loss scaler's factor must reach the fp16
  // activation gradients of the backward that runs here, not only the finished gradients),
  // else forwards only. `local`: model argument ids -> this rank's values. A defined
  // `loss_scale_tensor` (a GradScaler's scale on its device) is the factor instead: read on
  // the device, so that the host does not wait for the GPU to know it.
  StepOutputs step(const std::map<ir::ValueId, c10::IValue>& local, bool train, double loss_scale = 1.0,
                   const at::Tensor& loss_scale_tensor = {});
  // The forwards of a fill-drain step, stashing for backwardFrom(); lastForward() names it.
  // [Note: calls awaiting their backward] Several may await their backward (the user's
  // loss adds the outputs of several calls: a discriminator on real and fake batches, two
  // views of an image): each keeps its stashes (under keys of its own), its batch size
  // and what its backward reads (output shapes, which arguments get gradients, the
  // token-mean scales), until its backward runs or dropForward() says its outputs are gone.
  StepOutputs forwardForBackward(const std::map<ir::ValueId, c10::IValue>& local);
  int64_t lastForward() const { return last_forward_; }
  // Whether forward `id`'s backward has not run (nor was it dropped).
  bool awaitsBackward(int64_t id) const { return awaiting_.count(id) > 0; }
  // Makes forward `id` the one that scatterOutputGrads() and backwardFrom() serve: its batch
  // size, output shapes and argument gradients. Every rank resumes the same forwards in
  // the same order (autograd's, the same on every rank).
  void resumeForward(int64_t id);
  // The backwards of the forward resumeForward() named (else the last one). With `retain`
  // its stashes stay for another backward of it.
  // [Note: retained graphs] PyTorch runs a graph's backward again after
  // backward(retain_graph=True): a multi-task loop's l1.backward(retain_graph=True) then
  // l2.backward() through one forward's outputs, each adding its gradients to .grad. A
  // fill-drain forward's outputs then keep their stashes (and the stages' autograd graphs)
  // for the next backward, which computes afresh; and a 1F1B call's step gradients, which
  // its loss's backward adds again each time, reach .grad as a copy, never aliased, so that
  // the first addition's .grad is not the tensor the second one adds.
  void backwardFrom(Seeds seeds, bool retain = false);
  // Frees forward `id`'s stashes: its outputs are gone without a backward (local, no
  // communication).
  void dropForward(int64_t id);
  // Sends the gradients of this rank's rows of the batch outputs (id -> tensor shaped like
  // the local output, undefined for zeros) to the replicas that produced those rows; returns
  // the seeds of the batch outputs this stage produced (the reverse of the outputs' moves).
  Seeds scatterOutputGrads(const std::map<ir::ValueId, at::Tensor>& grads);

  // After a step with backwards: its gradients of ownParameters() (summed over each
  // gradient group), in its order, handed over: the engine keeps none. [Note: calls
  // awaiting their backward] Each training call keeps its own until the user's backward
  // reaches it: `model(a) + model(b)` runs two steps before one backward, and applying the
  // engine's last gradients there applied the second call's twice.
  std::shared_ptr<StepGrads> takeStepGrads();
  // .grad += scale * `grads` for ownParameters() (undefined scale: 1), one foreach call
  // each (a per-tensor loop cost 0.2 ms per step on a 150-tensor model); gradients taken
  // out of `grads` (undefined) are left to the caller.
  void applyStepGrads(const StepGrads& grads, const at::Tensor& scale);
  void applyStepGrads(const StepGrads& grads, double scale);
  // [Note: unsynced steps] Whether the steps that follow sum their gradients over each
  // gradient group (default). Off (RaNNCModule.no_sync, as DistributedDataParallel's),
  // each rank keeps its own share of the gradients; syncHeldGrads() then sums what .grad
  // accumulated, once, before the next summed step's gradients are added.
  void setGradSync(bool sync) { grad_sync_ = sync; }
  void syncHeldGrads();
  // After a step with backwards: the gradients of the arguments setInputGrads() named.
  const std::map<ir::ValueId, at::Tensor>& inputGrads() const { return input_grads_; }
  // The model's mean losses over a count the data decides ([Note: token-mean losses]).
  const frontend::TokenMeanLosses& tokenMeans() const { return *token_means_; }
  std::string describeTask(ir::TaskId task) const { return model_->describeTask(task); }
  std::string describeTerm(const ir::OutputTerm& term) const { return frontend::describeTerm(*model_, term); }
  // The dtype of output `value` of micro-batch `m` in the last forwards.
  at::ScalarType outputDtype(int m, ir::ValueId value) const;
  const StepTimes& lastStepTimes() const { return times_; }
  // The step program of `mode` for the current batch, printed.
  std::string program(StepMode mode);

 private:
  struct BatchConfig {
    Layout layout;
    std::vector<TransferPlan> plans;  // per chunk; the first carries the rank's own rows
    // per chunk and micro-batch: the outputs a later chunk of this rank reads (kept until
    // the step ends, [Note: chunks on a rank]); the others leave once sent
    std::vector<std::vector<std::set<ir::ValueId>>> read_locally;
    std::vector<partition::Action> train_actions;
    std::unique_ptr<Channels> device_channels;  // null: the host channels
    std::map<StepMode, StepProgram> programs;
    MicroBatchFit memory;  // the micro-batch count's predicted peak against the plan's limit
  };
  struct Chunk {
    Place place;
    bool recompute = false;
    std::unique_ptr<StageExecutor> executor;
    std::unordered_map<ir::ValueId, size_t> input_index, output_index;  // in the executor's lists
  };
  using ChunkBatch = std::pair<int, int>;  // (chunk, micro-batch)
  struct Posted {
    const Transfer* transfer;
    at::Tensor buffer;
    comm::WorkPtr work;  // null: this rank's own rows
  };
  using PostedByValue = std::map<ir::ValueId, std::vector<Posted>>;

  void configure(int64_t local_batch, bool cap_micro_batches);
  // The rows of micro-batch `m` at `place`, as a fraction of the global batch.
  double shareRows(const Place& place, int m) const;
  // Those rows named to the token-mean losses' ops while it lives (none without such ops).
  std::optional<frontend::ShareRows> shareScope(const Place& place, int m) const;
  // Before a step's forwards: the token-mean losses' share scales from the global target
  // counts ([Note: token-mean losses] in frontend/token_means.h). Collective when the
  // global batch is cut into several shares of such a loss's stage.
  // Returns the global counts set (undefined: the ops' own means), for resumeForward().
  at::Tensor scaleTokenMeans(const std::map<ir::ValueId, c10::IValue>& local);
  // The parameters and step gradients of `grads` that were not taken out.
  std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> definedStepGrads(const StepGrads& grads) const;
  // params[i].grad += grads[i].
  void addToGrads(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads);
  // The rows of batch outputs this rank owns, by (micro-batch, value, first row).
  std::vector<const Transfer*> ownedOutputRows() const;
  const StepProgram& programFor(StepMode mode);
  StepOutputs execute(const StepProgram& program, const std::map<ir::ValueId, c10::IValue>* local,
                      bool train);
  Channels& channels() { return config_->device_channels ? *config_->device_channels : *host_channels_; }
  Channels& channelsFor(Channel c) {
    return c == Channel::InputRows || c == Channel::InputGradient ? *host_channels_ : channels();
  }

  PostedByValue post(const StepAction& receive);
  c10::IValue gather(ir::ValueId vid, int m, const std::map<ir::ValueId, c10::IValue>& local,
                     PostedByValue& posted);
  c10::IValue shapeValue(ir::ValueId vid, int m) const;
  at::Tensor outputGrad(ir::ValueId vid, int m, PostedByValue& posted);
  void sendBackward(const StepAction& send, std::vector<comm::WorkPtr>& sends);
  const TransferPlan& ownRowsPlan() const { return config_->plans.front(); }
  std::vector<Posted> beginInputGrads();
  void finishInputGrads(std::vector<Posted>& posted);
  std::map<ir::ValueId, at::Tensor> collectBatchOutputs(
      const std::map<int, std::map<ir::ValueId, c10::IValue>>& produced);
  at::Tensor empty(ir::ValueId vid, const Transfer* rows, c10::Device device) const;
  at::Tensor narrow(const at::Tensor& t, ir::ValueId vid, const Transfer& tr, int64_t start) const;

  std::shared_ptr<const frontend::TracedModel> model_;
  const ir::Graph& graph_;
  partition::Deployment deployment_;
  int rank_, world_size_;
  c10::Device device_;
  bool nccl_;
  std::vector<ir::Subgraph> pieces_;
  std::map<ir::ValueId, int> producer_;
  std::set<ir::ValueId> graph_inputs_, graph_outputs_;
  ir::ValueId loss_id_ = ir::kNoId;
  const frontend::TokenMeanLosses* token_means_ = nullptr;  // owned by model_
  std::vector<int> token_mean_stages_;  // the stages that compute them
  std::set<ir::ValueId> summed_outputs_;
  std::vector<Chunk> chunks_;
  std::map<ir::ValueId, at::Tensor> stage_state_;
  std::map<ir::ValueId, at::Tensor> own_;
  std::unique_ptr<GradBuckets> buckets_;
  std::unique_ptr<Channels> host_channels_;
  std::map<int64_t, std::unique_ptr<BatchConfig>> configs_;
  BatchConfig* config_ = nullptr;
  std::set<ir::ValueId> input_grad_ids_;
  bool input_grads_known_ = false;
  bool grad_sync_ = true;  // [Note: unsynced steps]

  // [Note: calls awaiting their backward]
  struct AwaitingForward {
    int64_t local_batch = 0;
    std::set<ir::ValueId> input_grad_ids;
    std::map<int, std::map<ir::ValueId, std::pair<std::vector<int64_t>, at::ScalarType>>> shapes;
    std::map<ir::ValueId, std::pair<std::vector<int64_t>, at::ScalarType>> local_meta;
    at::Tensor token_counts;  // scaleTokenMeans()'s
  };
  static constexpr int64_t kStashKeys = 1 << 20;  // micro-batch keys per forward
  std::map<int64_t, AwaitingForward> awaiting_;
  int64_t last_forward_ = 0, resumed_ = 0;
  bool retain_stashes_ = false;  // backwardFrom(..., retain): the stages keep their stashes
  int64_t stash_base_ = 0;  // added to the micro-batch for the executors' stash keys

  // per step
  Seeds seeds_;
  std::map<int, std::map<ir::ValueId, std::pair<std::vector<int64_t>, at::ScalarType>>> shapes_;
  std::map<ChunkBatch, std::vector<c10::IValue>> outputs_;     // the last forward outputs (until sent)
  std::map<ChunkBatch, std::vector<at::Tensor>> input_grads_of_;  // the last backward's input grads
  // [Note: chunks on a rank]: outputs later chunks read, by (m, value); input gradients
  // earlier chunks read, by (m, value, first row), one per consuming chunk.
  std::map<std::pair<int, ir::ValueId>, c10::IValue> chunk_outputs_;
  std::multimap<std::tuple<int, ir::ValueId, int64_t>, at::Tensor> chunk_grads_;
  std::map<ir::ValueId, std::pair<std::vector<int64_t>, at::ScalarType>> local_meta_;
  std::map<ir::ValueId, at::Tensor> input_grads_;
  std::map<ir::ValueId, at::Tensor> step_grads_;
  StepTimes times_;
};

}  // namespace rannc::runtime
