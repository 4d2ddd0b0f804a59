#include "runtime/engine.h"

#include <algorithm>
#include <deque>
#include <optional>
#include <tuple>

#include "common/error.h"
#include "frontend/dtypes.h"
#include "frontend/token_means.h"

namespace rannc::runtime {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Restores the parameters' .grad on leaving a step with backwards, however it leaves.
class GradsAside {
 public:
  explicit GradsAside(const std::map<ir::ValueId, at::Tensor>& own) : own_(own) {
    for (const auto& [v, t] : own_) {
      saved_[v] = t.grad();
      t.mutable_grad() = at::Tensor();
    }
  }
  ~GradsAside() {
    for (const auto& [v, t] : own_) t.mutable_grad() = saved_[v];
  }

 private:
  const std::map<ir::ValueId, at::Tensor>& own_;
  std::map<ir::ValueId, at::Tensor> saved_;
};

}  // namespace

PipelineEngine::PipelineEngine(std::shared_ptr<const frontend::TracedModel> model,
                               partition::Deployment deployment, int rank, int world_size,
                               int64_t local_batch,
                               const std::unordered_map<ir::ValueId, at::Tensor>& state,
                               c10::Device device, bool nccl, int64_t bucket_bytes)
    : model_(std::move(model)), graph_(model_->graph), deployment_(std::move(deployment)),
      rank_(rank), world_size_(world_size), device_(device), nccl_(nccl) {
  // before the executors copy the operations ([Note: token-mean losses])
  token_means_ = &frontend::tokenMeanLosses(*model_);
  for (int s = 0; s < deployment_.numStages(); ++s) {
    pieces_.push_back(partition::stageSubgraph(graph_, deployment_.stages[s]));
    for (ir::ValueId v : pieces_.back().outputs) producer_[v] = s;
    for (const frontend::TokenMeanLoss& loss : token_means_->exact) {
      const auto& tasks = pieces_.back().tasks;
      if (std::find(tasks.begin(), tasks.end(), loss.task) != tasks.end()) token_mean_stages_.push_back(s);
    }
  }
  graph_inputs_ = {graph_.inputs().begin(), graph_.inputs().end()};
  graph_outputs_ = {graph_.outputs().begin(), graph_.outputs().end()};
  int losses = 0;
  for (ir::ValueId v : graph_.outputs()) {
    if (graph_.value(v).is_loss) {
      loss_id_ = v;
      ++losses;
    }
  }
  if (losses != 1) loss_id_ = ir::kNoId;
  host_channels_ = mpiChannels();
  {
    // the places are known from the layout of any batch; the chunks before the transfer plans
    Layout layout(deployment_, world_size_, local_batch);
    for (const Place& place : layout.places(rank_)) {
      Chunk chunk;
      chunk.place = place;
      chunk.recompute = deployment_.stages.at(place.stage).recompute;
      std::unordered_map<ir::ValueId, at::Tensor> chunk_state;
      for (ir::ValueId v : pieces_[place.stage].inputs) {
        auto it = state.find(v);
        if (it == state.end()) continue;
        chunk_state[v] = stage_state_[v] = it->second;
        if (it->second.requires_grad()) own_[v] = it->second;
      }
      chunk.executor = std::make_unique<StageExecutor>(model_, pieces_[place.stage], std::move(chunk_state), device_);
      const StageExecutor& ex = *chunk.executor;
      for (size_t i = 0; i < ex.inputIds().size(); ++i) chunk.input_index[ex.inputIds()[i]] = i;
      for (size_t i = 0; i < ex.outputIds().size(); ++i) chunk.output_index[ex.outputIds()[i]] = i;
      chunks_.push_back(std::move(chunk));
    }
  }
  configure(local_batch, false);
  // the gradient groups this rank is in, their communicators created in one order everywhere
  std::vector<std::pair<std::shared_ptr<comm::Communicator>, std::vector<ir::ValueId>>> groups;
  for (auto& [ranks, ids] : gradientGroups()) {
    if (std::find(ranks.begin(), ranks.end(), rank_) == ranks.end()) continue;
    std::vector<ir::ValueId> owned;
    for (ir::ValueId v : ids) {
      if (own_.count(v)) owned.push_back(v);
    }
    auto comm = ranks.size() > 1 ? groupCommunicator(ranks, nccl_, device_) : nullptr;
    groups.emplace_back(std::move(comm), std::move(owned));
  }
  std::map<ir::ValueId, int64_t> bytes;
  for (const auto& [v, _] : own_) bytes[v] = graph_.value(v).bytes();
  buckets_ = std::make_unique<GradBuckets>(std::move(groups), own_, bytes, device_.is_cuda() && !nccl_,
                                           bucket_bytes);
  setInputGrads({});
}

std::vector<int> PipelineEngine::stages() const {
  std::vector<int> out;
  for (const Chunk& c : chunks_) out.push_back(c.place.stage);
  return out;
}

int PipelineEngine::producerOf(ir::ValueId value) const {
  auto it = producer_.find(value);
  return it == producer_.end() ? -1 : it->second;
}

double PipelineEngine::shareWeight(ir::ValueId value, int m) const {
  if (summed_outputs_.count(value) > 0) return 1.0;  // each share's sum adds up
  // a mean over the batch: each share's mean weighs by its rows
  Place at = place();  // every chunk has the same copy and replica
  at.stage = producerOf(value);
  return shareRows(at, m);
}

double PipelineEngine::shareRows(const Place& place, int m) const {
  const Layout& L = config_->layout;
  return double(L.share(place.stage, place.copy, m, place.replica).size()) / double(L.globalBatch());
}

void PipelineEngine::setSummedOutputs(std::set<ir::ValueId> ids) {
  summed_outputs_ = std::move(ids);
  frontend::setTermPowers(*token_means_, summed_outputs_);
}

std::optional<frontend::ShareRows> PipelineEngine::shareScope(const Place& place, int m) const {
  if (token_means_->exact.empty() && token_means_->terms.empty()) return std::nullopt;
  return std::optional<frontend::ShareRows>(std::in_place, shareRows(place, m));
}

std::vector<ir::ValueId> PipelineEngine::batchOutputIds() const {
  std::vector<ir::ValueId> out;
  for (const auto& [v, _] : ownRowsPlan().out_recv) out.push_back(v);
  return out;
}

std::vector<std::pair<std::vector<int>, std::vector<ir::ValueId>>> PipelineEngine::gradientGroups() const {
  std::vector<ir::ValueId> state;
  for (ir::ValueId v : graph_.inputs()) {
    if (graph_.value(v).isModelState()) state.push_back(v);
  }
  return runtime::gradientGroups(pieces_, config_->layout, state);
}

void PipelineEngine::configure(int64_t local_batch, bool cap_micro_batches) {
  // the plan's micro-batch count (fewer for a batch too small for it), more where its
  // memory asks ([Note: memory at other batches] in batch_memory.h)
  const Layout planned(deployment_, world_size_, local_batch, cap_micro_batches);
  const MicroBatchFit fit = fitMicroBatches(deployment_, world_size_, local_batch, planned.microBatches());
  partition::Deployment at = deployment_;
  at.micro_batches = fit.micro_batches;
  auto config = std::unique_ptr<BatchConfig>(
      new BatchConfig{Layout(at, world_size_, local_batch), {}, {}, {}, nullptr, {}, fit});
  DescribeTask describe = [this](ir::TaskId t) { return model_->describeTask(t); };
  for (const Chunk& c : chunks_) {
    config->plans.push_back(planTransfers(graph_, pieces_, config->layout, rank_, describe, c.place.stage));
    auto& local = config->read_locally.emplace_back(config->plans.back().send.size());
    for (size_t m = 0; m < local.size(); ++m) {
      for (const auto& [vid, list] : config->plans.back().send[m]) {
        for (const Transfer& t : list) {
          if (t.dst == rank_) local[m].insert(vid);
        }
      }
    }
  }
  // device group g runs stages g, G + g, ...: its schedule is the g-th device's
  const int groups = deployment_.deviceGroups();
  config->train_actions = partition::buildSchedule(deployment_.schedule, groups, config->layout.microBatches(),
                                                   deployment_.chunks)[place().stage % groups];
  if (nccl_) {
    std::set<ChannelKey> keys;
    for (const TransferPlan& plan : config->plans) {
      for (const ChannelKey& k : plan.deviceChannels(graph_)) keys.insert(k);
    }
    config->device_channels = ncclChannels({keys.begin(), keys.end()}, device_);
  }
  config_ = config.get();
  configs_[local_batch] = std::move(config);
}

bool PipelineEngine::useBatch(int64_t local_batch) {
  if (local_batch == config_->layout.localBatch()) return false;
  auto it = configs_.find(local_batch);
  if (it != configs_.end()) {
    config_ = it->second.get();
    return false;
  }
  configure(local_batch, true);
  return true;
}

void PipelineEngine::setInputGrads(std::set<ir::ValueId> ids) {
  if (input_grads_known_ && ids == input_grad_ids_) return;
  input_grad_ids_ = std::move(ids);
  input_grads_known_ = true;
  for (Chunk& c : chunks_) {
    std::vector<ir::ValueId> no_grad;
    for (ir::ValueId v : c.executor->inputIds()) {
      // a graph input nobody asked a gradient of, or a value without one (a mask, a
      // teacher's output under no_grad: [Note: no_grad in forward] in _trace.py), which no
      // transfer carries back; as a leaf that required grad it cost a backward, and a
      // buffer updated in place from it took autograd history
      const bool unasked = graph_inputs_.count(v) ? !input_grad_ids_.count(v) : !graph_.value(v).requires_grad;
      if (unasked) no_grad.push_back(v);
    }
    c.executor->setNoGradInputs(no_grad);
  }
  for (auto& [_, c] : configs_) c->programs.clear();
}

const StepProgram& PipelineEngine::programFor(StepMode mode) {
  auto it = config_->programs.find(mode);
  if (it != config_->programs.end()) return it->second;
  std::vector<partition::Action> compute;
  const auto& train = config_->train_actions;
  auto only = [&](partition::ActionKind kind) {
    for (const auto& a : train) {
      if (a.kind == kind) compute.push_back(a);
    }
  };
  switch (mode) {
    case StepMode::Train: compute = train; break;
    case StepMode::Eval:
      for (int c = 0; c < static_cast<int>(chunks_.size()); ++c) {
        for (int m = 0; m < config_->layout.microBatches(); ++m) {
          compute.push_back({partition::ActionKind::Forward, m, c});
        }
      }
      break;
    case StepMode::FillDrainForward: only(partition::ActionKind::Forward); break;
    case StepMode::FillDrainBackward: only(partition::ActionKind::Backward); break;
  }
  std::vector<const TransferPlan*> plans;
  std::vector<StageBoundary> boundaries;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    plans.push_back(&config_->plans[c]);
    boundaries.push_back({chunks_[c].executor->inputIds(), chunks_[c].executor->outputIds()});
  }
  auto program = lowerStep(compute, plans, graph_, boundaries, input_grad_ids_, !buckets_->empty());
  return config_->programs[mode] = std::move(program);
}

std::string PipelineEngine::program(StepMode mode) { return programFor(mode).str(); }

StepOutputs PipelineEngine::step(const std::map<ir::ValueId, c10::IValue>& local, bool train,
                                 double loss_scale, const at::Tensor& loss_scale_tensor) {
  seeds_.clear();
  stash_base_ = 0;  // a step's backwards run in it ([Note: calls awaiting their backward])
  if (train && loss_id_ != ir::kNoId) {
    const std::vector<int> mine = stages();
    if (std::count(mine.begin(), mine.end(), producerOf(loss_id_)) > 0) {
      for (int m = 0; m < config_->layout.microBatches(); ++m) {
        const double weight = loss_scale * shareWeight(loss_id_, m);
        if (loss_scale_tensor.defined()) {  // in float64, then rounded once, as the value is
          seeds_[m][loss_id_] = Seed{0.0, (loss_scale_tensor.reshape({}).to(at::kDouble) * weight)
                                              .to(loss_scale_tensor.scalar_type())};
        } else {
          seeds_[m][loss_id_] = Seed{weight, {}};
        }
      }
    }
  }
  scaleTokenMeans(local);
  return execute(programFor(train ? StepMode::Train : StepMode::Eval), &local, train);
}

at::Tensor PipelineEngine::scaleTokenMeans(const std::map<ir::ValueId, c10::IValue>& local) {
  if (token_means_->exact.empty()) return {};
  const Layout& L = config_->layout;
  bool shared = false;  // the same on every rank: the layout is global
  for (int s : token_mean_stages_) shared |= L.microBatches() * L.pipelines() * L.replicas(s) > 1;
  if (!shared) {  // one share of the global batch: the op's own mean is the global one
    frontend::setShareScales(*token_means_, nullptr);
    return {};
  }
  at::Tensor counts = frontend::localTargetCounts(*model_, *token_means_, local);
  if (world_size_ > 1) comm::worldCpuCommunicator()->allReduce(counts)->wait();
  frontend::setShareScales(*token_means_, &counts, device_);
  return counts;
}

StepOutputs PipelineEngine::forwardForBackward(const std::map<ir::ValueId, c10::IValue>& local) {
  // [Note: calls awaiting their backward]
  AwaitingForward awaiting;
  awaiting.token_counts = scaleTokenMeans(local);
  last_forward_ = resumed_ = last_forward_ + 1;
  stash_base_ = last_forward_ * kStashKeys;
  StepOutputs outs;
  try {
    outs = execute(programFor(StepMode::FillDrainForward), &local, true);
  } catch (...) {
    for (Chunk& c : chunks_) c.executor->discard(stash_base_, stash_base_ + kStashKeys);
    throw;
  }
  awaiting.local_batch = config_->layout.localBatch();
  awaiting.input_grad_ids = input_grad_ids_;
  awaiting.shapes = shapes_;
  awaiting.local_meta = local_meta_;
  awaiting_[last_forward_] = std::move(awaiting);
  return outs;
}

void PipelineEngine::resumeForward(int64_t id) {
  auto it = awaiting_.find(id);
  RANNC_CHECK(it != awaiting_.end(), "forward " << id << " awaits no backward");
  const AwaitingForward& f = it->second;
  useBatch(f.local_batch);
  setInputGrads(f.input_grad_ids);
  shapes_ = f.shapes;
  local_meta_ = f.local_meta;
  if (!token_means_->exact.empty()) {  // read again where a stage recomputes
    frontend::setShareScales(*token_means_, f.token_counts.defined() ? &f.token_counts : nullptr, device_);
  }
  resumed_ = id;
  stash_base_ = id * kStashKeys;
}

void PipelineEngine::backwardFrom(Seeds seeds, bool retain) {
  RANNC_CHECK(awaiting_.count(resumed_), "forward " << resumed_ << " awaits no backward");
  seeds_ = std::move(seeds);
  // its stashes are consumed (kept with `retain`: [Note: retained graphs]), or dropped if
  // the backward fails
  if (!retain) awaiting_.erase(resumed_);
  retain_stashes_ = retain;
  try {
    execute(programFor(StepMode::FillDrainBackward), nullptr, true);
  } catch (...) {
    retain_stashes_ = false;
    awaiting_.erase(resumed_);
    for (Chunk& c : chunks_) c.executor->discard(stash_base_, stash_base_ + kStashKeys);
    throw;
  }
  retain_stashes_ = false;
}

void PipelineEngine::dropForward(int64_t id) {
  if (awaiting_.erase(id) == 0) return;
  for (Chunk& c : chunks_) c.executor->discard(id * kStashKeys, (id + 1) * kStashKeys);
}

at::Tensor PipelineEngine::empty(ir::ValueId vid, const Transfer* rows, c10::Device device) const {
  const ir::Value& v = graph_.value(vid);
  std::vector<int64_t> shape = v.shape;
  if (rows != nullptr && !rows->whole) shape[v.batch_dim] = rows->rows.size() * v.batch_multiple;
  return at::empty(shape, at::TensorOptions().dtype(frontend::toScalarType(v.dtype)).device(device));
}

at::Tensor PipelineEngine::narrow(const at::Tensor& t, ir::ValueId vid, const Transfer& tr, int64_t start) const {
  if (tr.whole) return t;
  const ir::Value& v = graph_.value(vid);
  return t.narrow(v.batch_dim, (tr.rows.start - start) * v.batch_multiple, tr.rows.size() * v.batch_multiple);
}

PipelineEngine::PostedByValue PipelineEngine::post(const StepAction& receive) {
  PostedByValue posted;
  const bool forward = receive.feeds == partition::ActionKind::Forward;
  for (const ChannelTransfer& ct : receive.transfers) {
    const Transfer& t = ct.transfer;
    auto& list = posted[t.value];
    if (ct.local) {
      list.push_back({&t, {}, nullptr});
      continue;
    }
    at::Tensor buf = empty(t.value, &t, device_);
    int peer = forward ? t.src : t.dst;  // a gradient comes back from the consumer
    list.push_back({&t, buf, channelsFor(ct.channel).recv(buf, peer, ct.channel, t.lane)});
  }
  return posted;
}

c10::IValue PipelineEngine::shapeValue(ir::ValueId vid, int m) const {
  const ir::Value& v = graph_.value(vid);
  const Layout& L = config_->layout;
  int64_t rows = L.share(place().stage, place().copy, m, place().replica).size();
  std::vector<int64_t> ints;
  for (size_t i = 0; i < v.int_values.size(); ++i) {
    int64_t k = v.int_batch_multiples.at(i);
    ints.push_back(k != 0 ? k * rows : v.int_values[i]);
  }
  if (v.kind == ir::ValueKind::IntList) return ints;
  if (v.kind == ir::ValueKind::Tensor) {
    return at::scalar_tensor(ints.at(0), at::TensorOptions().dtype(frontend::toScalarType(v.dtype)));
  }
  // An int, or a Scalar holding one (aten::ScalarImplicit's result, kind Other: a 0-dim
  // tensor made an argument such as torch.arange's end); a tensor there fails the op.
  return ints.at(0);
}

c10::IValue PipelineEngine::gather(ir::ValueId vid, int m, const std::map<ir::ValueId, c10::IValue>& local,
                                   PostedByValue& posted) {
  if (isShapeValue(graph_.value(vid))) return shapeValue(vid, m);
  auto it = posted.find(vid);
  RANNC_CHECK(it != posted.end(), "rank " << rank_ << ": input " << vid << " of micro-batch " << m
                                          << " was never received");
  std::vector<at::Tensor> parts;
  for (Posted& p : it->second) {
    if (p.work == nullptr && !graph_inputs_.count(vid)) {  // another chunk's output
      auto out = chunk_outputs_.find({m, vid});
      RANNC_CHECK(out != chunk_outputs_.end(), "rank " << rank_ << ": value " << vid << " of micro-batch " << m
                                                       << " is read before its stage ran");
      parts.push_back(narrow(out->second.toTensor(), vid, *p.transfer, p.transfer->src_start));
    } else if (p.work == nullptr) {
      auto lt = local.find(vid);
      RANNC_CHECK(lt != local.end(), "rank " << rank_ << " lacks its own rows of argument " << vid);
      if (!lt->second.isTensor()) return lt->second;  // a non-tensor argument, whole
      parts.push_back(narrow(lt->second.toTensor(), vid, *p.transfer, p.transfer->src_start).to(device_));
    } else {
      auto t0 = Clock::now();
      p.work->wait();
      times_.wait += since(t0);
      parts.push_back(p.buffer);
    }
  }
  if (parts.size() == 1) return parts[0];
  return at::cat(parts, graph_.value(vid).batch_dim);
}

at::Tensor PipelineEngine::outputGrad(ir::ValueId vid, int m, PostedByValue& posted) {
  auto shape_it = shapes_[m].find(vid);
  at::Tensor grad;
  auto sm = seeds_.find(m);
  if (sm != seeds_.end()) {
    auto s = sm->second.find(vid);
    if (s != sm->second.end()) {
      if (s->second.tensor.defined()) {
        grad = s->second.tensor.to(device_, /*non_blocking=*/false, /*copy=*/true);
        if (shape_it != shapes_[m].end()) grad = grad.reshape(shape_it->second.first);  // a [1] loss
      } else {
        RANNC_CHECK(shape_it != shapes_[m].end(), "no forward output " << vid << " for micro-batch " << m);
        grad = at::full(shape_it->second.first, s->second.value,
                        at::TensorOptions().dtype(shape_it->second.second).device(device_));
      }
    }
  }
  auto it = posted.find(vid);
  if (it != posted.end()) {
    if (!grad.defined()) {
      RANNC_CHECK(shape_it != shapes_[m].end(), "no forward output " << vid << " for micro-batch " << m);
      grad = at::zeros(shape_it->second.first, at::TensorOptions().dtype(shape_it->second.second).device(device_));
    }
    for (Posted& p : it->second) {
      const Transfer& t = *p.transfer;
      if (p.work == nullptr) {  // from a later chunk of this rank; nothing if it had no gradient
        auto g = chunk_grads_.find({m, vid, t.whole ? 0 : t.rows.start});
        if (g == chunk_grads_.end()) continue;
        narrow(grad, vid, t, t.src_start).add_(g->second);
        chunk_grads_.erase(g);
        continue;
      }
      auto t0 = Clock::now();
      p.work->wait();
      times_.wait += since(t0);
      narrow(grad, vid, t, t.src_start).add_(p.buffer);
    }
  }
  return grad;
}

void PipelineEngine::sendBackward(const StepAction& send, std::vector<comm::WorkPtr>& sends) {
  const int m = send.micro_batch;
  const auto& grads = input_grads_of_.at({send.chunk, m});
  const auto& index = chunks_[send.chunk].input_index;
  const int64_t mine = config_->layout.owned(rank_).start;
  for (const ChannelTransfer& ct : send.transfers) {
    const Transfer& t = ct.transfer;
    const at::Tensor& g = grads.at(index.at(t.value));
    if (ct.channel == Channel::InputGradient) {
      if (!g.defined()) continue;
      at::Tensor& total = input_grads_.at(t.value);
      if (t.whole) {
        total.add_(g.to(total.scalar_type()));
      } else if (ct.local) {
        narrow(total, t.value, t, mine).add_(narrow(g, t.value, t, t.dst_start));
      } else {
        sends.push_back(host_channels_->send(narrow(g, t.value, t, t.dst_start).contiguous(), t.src,
                                             Channel::InputGradient, t.lane));
      }
      continue;
    }
    if (ct.local) {  // for an earlier chunk of this rank ([Note: chunks on a rank])
      if (g.defined()) chunk_grads_.emplace(std::make_tuple(m, t.value, t.whole ? 0 : t.rows.start),
                                            narrow(g, t.value, t, t.dst_start));
      continue;
    }
    at::Tensor piece = g.defined() ? narrow(g, t.value, t, t.dst_start).contiguous()
                                   : empty(t.value, &t, device_).zero_();
    sends.push_back(channels().send(piece, t.src, Channel::Gradient, t.lane));
  }
  input_grads_of_.erase({send.chunk, m});
}

std::vector<PipelineEngine::Posted> PipelineEngine::beginInputGrads() {
  input_grads_.clear();
  for (const auto& [vid, meta] : local_meta_) {
    if (input_grad_ids_.count(vid)) {
      input_grads_[vid] = at::zeros(meta.first, at::TensorOptions().dtype(meta.second).device(device_));
    }
  }
  std::vector<Posted> posted;
  for (const Transfer& t : ownRowsPlan().input_sends) {
    if (!input_grad_ids_.count(t.value)) continue;
    at::Tensor buf = empty(t.value, &t, device_);
    posted.push_back({&t, buf, host_channels_->recv(buf, t.dst, Channel::InputGradient, t.lane)});
  }
  return posted;
}

void PipelineEngine::finishInputGrads(std::vector<Posted>& posted) {
  const int64_t mine = config_->layout.owned(rank_).start;
  for (Posted& p : posted) {
    p.work->wait();
    narrow(input_grads_.at(p.transfer->value), p.transfer->value, *p.transfer, mine).add_(p.buffer);
  }
  for (auto& [vid, grad] : input_grads_) {  // every rank, in one order: a collective
    if (graph_.value(vid).isBatch()) {
      if (world_size_ > 1) grad.mul_(static_cast<double>(world_size_));  // [Note: input gradients]
      continue;
    }
    at::Tensor total = grad.to(c10::kCPU, at::kDouble);
    comm::worldCpuCommunicator()->allReduce(total)->wait();
    grad = total.to(device_, grad.scalar_type());
  }
}

std::vector<const Transfer*> PipelineEngine::ownedOutputRows() const {
  std::vector<const Transfer*> order;
  for (const auto& [_, list] : ownRowsPlan().out_recv) {
    for (const Transfer& t : list) order.push_back(&t);
  }
  std::stable_sort(order.begin(), order.end(), [](const Transfer* a, const Transfer* b) {
    return std::make_tuple(a->micro_batch, a->value, a->rows.start) <
           std::make_tuple(b->micro_batch, b->value, b->rows.start);
  });
  return order;
}

std::map<ir::ValueId, at::Tensor> PipelineEngine::collectBatchOutputs(
    const std::map<int, std::map<ir::ValueId, c10::IValue>>& produced) {
  const std::vector<const Transfer*> order = ownedOutputRows();
  std::map<ir::ValueId, std::vector<std::pair<int64_t, at::Tensor>>> parts;
  std::vector<comm::WorkPtr> works;
  for (const Transfer* t : order) {
    at::Tensor part;
    if (t->src == rank_) {
      part = narrow(produced.at(t->micro_batch).at(t->value).toTensor(), t->value, *t, t->src_start);
    } else {
      part = empty(t->value, t, device_);
      works.push_back(channels().recv(part, t->src, Channel::BatchOutput, t->lane));
    }
    parts[t->value].emplace_back(t->rows.start, part);
  }
  auto t0 = Clock::now();
  for (auto& w : works) w->wait();
  times_.wait += since(t0);
  std::map<ir::ValueId, at::Tensor> out;
  for (auto& [vid, list] : parts) {
    std::stable_sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<at::Tensor> tensors;
    for (auto& [_, t] : list) tensors.push_back(t);
    // one part is the whole value (one micro-batch on one rank): no copy of, say, the logits
    out[vid] = tensors.size() == 1 ? tensors[0] : at::cat(tensors, graph_.value(vid).batch_dim);
  }
  return out;
}

StepOutputs PipelineEngine::execute(const StepProgram& program,
                                    const std::map<ir::ValueId, c10::IValue>* local, bool train) {
  auto start = Clock::now();
  times_ = StepTimes{};
  StepOutputs result;
  std::vector<comm::WorkPtr> sends;
  std::deque<PostedByValue> upcoming;
  std::vector<Posted> input_grad_receives;
  const bool has_backward = std::any_of(program.actions.begin(), program.actions.end(),
                                        [](const StepAction& a) {
                                          return a.kind == StepActionKind::Backward ||
                                                 a.kind == StepActionKind::BackwardInput;
                                        });
  const bool has_forward = local != nullptr;
  std::optional<GradsAside> aside;
  if (has_backward) aside.emplace(own_);
  if (has_forward) {
    chunk_outputs_.clear();
    shapes_.clear();
    local_meta_.clear();
    for (ir::ValueId vid : input_grad_ids_) {
      const at::Tensor& t = local->at(vid).toTensor();
      local_meta_[vid] = {t.sizes().vec(), t.scalar_type()};
    }
  }
  if (has_backward && !input_grad_ids_.empty()) input_grad_receives = beginInputGrads();
  struct Disarm {
    GradBuckets& b;
    ~Disarm() { b.disarm(); }
  } disarm{*buckets_};

  for (const StepAction& a : program.actions) {
    switch (a.kind) {
      case StepActionKind::SendInputRows:
        for (const ChannelTransfer& ct : a.transfers) {
          const Transfer& t = ct.transfer;
          at::Tensor rows = narrow(local->at(t.value).toTensor(), t.value, t, t.src_start).contiguous();
          sends.push_back(host_channels_->send(rows, t.dst, Channel::InputRows, t.lane));
        }
        break;
      case StepActionKind::Receive:
        upcoming.push_back(post(a));
        break;
      case StepActionKind::Forward: {
        RANNC_CHECK(!upcoming.empty(), "forward " << a.micro_batch << " without its receives");
        PostedByValue posted = std::move(upcoming.front());
        upcoming.pop_front();
        Chunk& chunk = chunks_[a.chunk];
        std::vector<c10::IValue> ins;
        for (ir::ValueId vid : chunk.executor->inputIds()) ins.push_back(gather(vid, a.micro_batch, *local, posted));
        auto t0 = Clock::now();
        const auto share = shareScope(chunk.place, a.micro_batch);
        auto outs = chunk.executor->forward(stash_base_ + a.micro_batch, ins, train, chunk.recompute);
        times_.forward += since(t0);
        const auto& ids = chunk.executor->outputIds();
        auto& shapes = shapes_[a.micro_batch];
        auto& produced = result.produced[a.micro_batch];
        for (size_t i = 0; i < ids.size(); ++i) {
          if (outs[i].isTensor()) shapes[ids[i]] = {outs[i].toTensor().sizes().vec(), outs[i].toTensor().scalar_type()};
          if (graph_outputs_.count(ids[i])) produced[ids[i]] = outs[i];
          if (config_->read_locally[a.chunk][a.micro_batch].count(ids[i])) {
            chunk_outputs_[{a.micro_batch, ids[i]}] = outs[i];
          }
        }
        outputs_[{a.chunk, a.micro_batch}] = std::move(outs);
        break;
      }
      case StepActionKind::Backward:
      case StepActionKind::BackwardInput: {
        RANNC_CHECK(!upcoming.empty(), "backward " << a.micro_batch << " without its receives");
        PostedByValue posted = std::move(upcoming.front());
        upcoming.pop_front();
        StageExecutor& executor = *chunks_[a.chunk].executor;
        std::vector<at::Tensor> grads;
        for (ir::ValueId vid : executor.outputIds()) grads.push_back(outputGrad(vid, a.micro_batch, posted));
        auto t0 = Clock::now();
        const auto share = shareScope(chunks_[a.chunk].place, a.micro_batch);  // recomputation
        const int64_t key = stash_base_ + a.micro_batch;
        input_grads_of_[{a.chunk, a.micro_batch}] = a.kind == StepActionKind::Backward
                                                        ? executor.backward(key, grads, retain_stashes_)
                                                        : executor.backwardInput(key, grads);
        times_.backward += since(t0);
        break;
      }
      case StepActionKind::BackwardWeight: {
        auto t0 = Clock::now();
        chunks_[a.chunk].executor->backwardWeight(stash_base_ + a.micro_batch);
        times_.backward += since(t0);
        break;
      }
      case StepActionKind::Send:
        if (a.feeds == partition::ActionKind::Forward) {
          const auto& outs = outputs_.at({a.chunk, a.micro_batch});
          const auto& index = chunks_[a.chunk].output_index;
          for (const ChannelTransfer& ct : a.transfers) {
            const Transfer& t = ct.transfer;
            const c10::IValue& out = outs.at(index.at(t.value));
            at::Tensor piece = narrow(out.toTensor(), t.value, t, t.src_start).contiguous();
            sends.push_back(channels().send(piece, t.dst, ct.channel, t.lane));
          }
          outputs_.erase({a.chunk, a.micro_batch});
        } else {
          sendBackward(a, sends);
        }
        break;
      case StepActionKind::ArmAllReduce:
        if (grad_sync_) buckets_->arm();
        break;
      case StepActionKind::CollectOutputs:
        result.batch_outputs = collectBatchOutputs(result.produced);
        break;
      case StepActionKind::Finish: {
        auto t0 = Clock::now();
        for (auto& w : sends) w->wait();
        if (has_backward && !input_grad_ids_.empty()) finishInputGrads(input_grad_receives);
        chunk_outputs_.clear();
        chunk_grads_.clear();
        outputs_.clear();  // those no send took (the last stage's): not past the step
        if (has_backward) {
          step_grads_.clear();
          // A parameter no gradient reached (read through a detach only: a teacher under
          // torch.no_grad(), [Note: no_grad in forward] in python/rannc/_trace.py) keeps
          // .grad None, as in PyTorch, so that AdamW does not decay it; one that another
          // stage's gradient reached gets the sum ([Note: gradients reached elsewhere]).
          for (const auto& [v, t] : own_) step_grads_[v] = t.grad();
          if (grad_sync_) buckets_->finish(step_grads_);  // the sums, from .grad
        }
        times_.wait += since(t0);
        break;
      }
    }
  }
  times_.total = since(start);
  return result;
}

Seeds PipelineEngine::scatterOutputGrads(const std::map<ir::ValueId, at::Tensor>& grads) {
  const std::vector<const Transfer*> order = ownedOutputRows();
  std::vector<comm::WorkPtr> sends;
  std::map<std::tuple<int, ir::ValueId, int64_t>, at::Tensor> mine;
  for (const Transfer* t : order) {
    auto g = grads.find(t->value);
    at::Tensor piece = g != grads.end() && g->second.defined()
                           ? narrow(g->second, t->value, *t, t->dst_start).to(device_).contiguous()
                           : empty(t->value, t, device_).zero_();
    if (t->src == rank_) {
      mine[{t->micro_batch, t->value, t->rows.start}] = piece;
    } else {
      sends.push_back(channels().send(piece, t->src, Channel::OutputGradient, t->lane));
    }
  }
  std::vector<Posted> posted;
  for (const TransferPlan& plan : config_->plans) {
    for (const auto& table : plan.out_send) {
      for (const auto& [vid, list] : table) {
        for (const Transfer& t : list) {
          if (t.dst == rank_) {
            posted.push_back({&t, mine.at({t.micro_batch, vid, t.rows.start}), nullptr});
          } else {
            at::Tensor buf = empty(vid, &t, device_);
            posted.push_back({&t, buf, channels().recv(buf, t.dst, Channel::OutputGradient, t.lane)});
          }
        }
      }
    }
  }
  Seeds seeds;
  for (Posted& p : posted) {
    if (p.work) p.work->wait();
    const Transfer& t = *p.transfer;
    Seed& seed = seeds[t.micro_batch][t.value];
    if (!seed.tensor.defined()) {
      const auto& meta = shapes_.at(t.micro_batch).at(t.value);
      seed.tensor = at::zeros(meta.first, at::TensorOptions().dtype(meta.second).device(device_));
    }
    narrow(seed.tensor, t.value, t, t.src_start).add_(p.buffer);
  }
  for (auto& w : sends) w->wait();
  return seeds;
}

std::shared_ptr<StepGrads> PipelineEngine::takeStepGrads() {
  auto grads = std::make_shared<StepGrads>();
  if (step_grads_.empty()) return grads;  // no backward ran, or taken already
  for (const auto& [v, _] : own_) grads->tensors.push_back(step_grads_.at(v));
  step_grads_.clear();
  return grads;
}

void PipelineEngine::applyStepGrads(const StepGrads& grads, const at::Tensor& scale) {
  auto [params, add] = definedStepGrads(grads);
  if (add.empty()) return;
  // in place: the step's gradients are this call's own (a retained graph's are copies)
  if (scale.defined()) at::_foreach_mul_(add, scale);
  addToGrads(params, add);
}

void PipelineEngine::applyStepGrads(const StepGrads& grads, double scale) {
  auto [params, add] = definedStepGrads(grads);
  if (add.empty()) return;
  if (scale != 1.0) at::_foreach_mul_(add, at::Scalar(scale));
  addToGrads(params, add);
}

std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> PipelineEngine::definedStepGrads(
    const StepGrads& grads) const {
  std::vector<at::Tensor> params, add;
  if (grads.tensors.empty()) return {params, add};  // no parameters here, or no backward
  RANNC_CHECK(grads.tensors.size() == own_.size(), "step gradients of another engine");
  size_t i = 0;
  for (const auto& [_, p] : own_) {
    const at::Tensor& g = grads.tensors[i++];
    if (!g.defined()) continue;  // taken out (a parameter with hooks, [Note: parameter hooks])
    params.push_back(p);
    add.push_back(g);
  }
  return {params, add};
}

void PipelineEngine::syncHeldGrads() {
  if (buckets_->empty()) return;
  std::map<ir::ValueId, at::Tensor> sums;
  buckets_->finish(sums);  // every bucket, from .grad (zeros where undefined)
  for (const auto& [v, sum] : sums) {
    // undefined: no rank's stage reached it, so it stays None ([Note: gradients reached
    // elsewhere] in grad_buckets.h)
    if (!sum.defined()) continue;
    at::Tensor& grad = own_.at(v).mutable_grad();
    if (grad.defined()) {
      grad.copy_(sum);
    } else {
      grad = sum.clone();
    }
  }
}

void PipelineEngine::addToGrads(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> into, add;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].grad().defined()) {
      into.push_back(params[i].grad());
      add.push_back(grads[i]);
    } else {
      params[i].mutable_grad() = grads[i];
    }
  }
  if (!into.empty()) at::_foreach_add_(into, add);
}

at::ScalarType PipelineEngine::outputDtype(int m, ir::ValueId value) const {
  return shapes_.at(m).at(value).second;
}

}  // namespace rannc::runtime
