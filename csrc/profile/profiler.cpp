#include "profile/profiler.h"

#include <algorithm>
#include <limits>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "common/error.h"
#include "common/hash.h"
#include "frontend/interpreter.h"
#include "frontend/placement.h"
#include "frontend/split_backward.h"
#include "ir/subgraph.h"
#include "partition/cost/cost_model.h"
#include "profile/device_meter.h"

namespace rannc::profile {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int64_t tensorBytes(const c10::IValue& v) {
  if (!v.isTensor()) return 0;
  const at::Tensor& t = v.toTensor();
  return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0;
}

}  // namespace

std::string Profiler::describePiece(const ir::Subgraph& piece) const {
  if (piece.tasks.empty()) return "an empty piece";
  const auto [first, last] = std::minmax_element(piece.tasks.begin(), piece.tasks.end());
  std::string s = "the piece of " + std::to_string(piece.tasks.size()) + " tasks from task " +
                  std::to_string(*first) + " (" + model_->describeTask(*first) + ")";
  if (*last != *first) {
    s += " to task " + std::to_string(*last) + " (" + model_->describeTask(*last) + ")";
  }
  return s;
}

Profiler::Profiler(std::shared_ptr<const frontend::TracedModel> model,
                   std::shared_ptr<const BoundaryInputs> inputs, ProfilerOptions options)
    : model_(std::move(model)),
      inputs_(std::move(inputs)),
      options_(std::move(options)),
      device_(parseProfileDevice(options_.device)),
      // Forward-only records are other measurements: cached apart.
      device_kind_(profile::deviceKind(device_) + (options_.forward_only ? "/forward" : "")) {
  if (options_.repetitions < 1) throw Error("profiling needs at least one repetition");
  if (options_.warmup < 0) throw Error("profiling warm-up runs cannot be negative");
  run_model_ = frontend::onDevice(model_, device_);
}

ProfileRecord Profiler::fakeTimes(const ir::Subgraph& piece, int64_t rows, bool recompute) const {
  // A made-up but smooth cost: a fixed charge per task plus the bytes each task writes.
  const ir::Graph& g = model_->graph;
  double fwd = 0.0;
  for (ir::TaskId t : piece.tasks) {
    fwd += 2e-6;
    for (ir::ValueId v : g.task(t).outputs) {
      fwd += static_cast<double>(partition::valueBytesAt(g, g.value(v), rows)) * 1e-10;
    }
  }
  ProfileRecord r;
  r.forward_time = fwd;
  r.backward_time = options_.forward_only ? 0.0 : 2.0 * fwd + (recompute ? fwd : 0.0);
  return r;
}

ProfileRecord Profiler::measure(const ir::Subgraph& piece, int64_t rows, bool recompute) {
  RANNC_CHECK(rows >= 1, "profiling at " << rows << " rows");
  ProfileRecord r;
  {
    std::unique_ptr<DeviceMeter> meter = makeDeviceMeter(device_, options_.memory_limit, options_.cpu_clock);
    try {
      r = measureOnce(*meter, piece, rows, recompute, options_.warmup + options_.repetitions);
    } catch (const c10::OutOfMemoryError&) {
      r = ProfileRecord();
      r.out_of_memory = true;
    } catch (const std::bad_alloc&) {
      r = ProfileRecord();
      r.out_of_memory = true;
    } catch (const std::exception& e) {
      // The interpreter wraps the allocator's error in one naming the op.
      if (!meter->refused()) {
        throw Error("profiling " + describePiece(piece) + " at " + std::to_string(rows) +
                    " rows failed: " + e.what());
      }
      r = ProfileRecord();
      r.out_of_memory = true;
    }
  }  // the meter restores the CPU allocator's limit / empties the CUDA cache after an OOM
  if (r.out_of_memory) {
    r.forward_time = r.backward_time = std::numeric_limits<double>::infinity();
    r.activation_bytes = r.peak_bytes = std::max<int64_t>(options_.memory_limit, 1) + 1;
    return r;
  }
  if (options_.fake_timer) {
    ProfileRecord fake = fakeTimes(piece, rows, recompute);
    if (options_.fake_noise > 0.0) {
      const uint64_t h = Fnv1a()
                             .u64(options_.fake_seed)
                             .u64(ir::contentHash(model_->graph, piece))
                             .i64(rows)
                             .u64(fake_draws_++)
                             .digest();
      const double u = static_cast<double>(h % 1000003) / 1000002.0;  // [0, 1]
      const double factor = 1.0 + options_.fake_noise * (2.0 * u - 1.0);
      fake.forward_time *= factor;
      fake.backward_time *= factor;
    }
    r.forward_time = fake.forward_time;
    r.backward_time = fake.backward_time;
    // A deterministic weight part where one was measured: half the backward ([Note: weight
    // gradient share] in partition/stage/stage_cost.h).
    if (r.weight_time > 0) r.weight_time = 0.5 * fake.backward_time;
  }
  return r;
}

ProfileRecord Profiler::measureOnce(DeviceMeter& meter, const ir::Subgraph& piece, int64_t rows,
                                    bool recompute, int runs) {
  std::vector<c10::IValue> inputs = inputs_->make(piece, rows);
  const auto ids = frontend::runPieceInputs(*model_, piece);
  // On the device: the parameters and buffers first, so that the limit, like the CPU
  // counter's, counts the other inputs and what the runs allocate (the planner charges
  // the parameters itself).
  auto place = [&](bool state) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (model_->graph.value(ids[i]).isModelState() == state) {
        inputs[i] = frontend::toDevice(inputs[i], device_);
      }
    }
  };
  place(true);
  const int64_t limit_base = meter.current();
  place(false);
  // The parameters' gradients are charged by the planner's memory model (params x 2).
  std::vector<at::Tensor> leaves;
  std::vector<char> leaf_is_state;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].isTensor()) continue;
    const at::Tensor& t = inputs[i].toTensor();
    if (!t.defined() || !t.requires_grad()) continue;
    leaves.push_back(t);
    leaf_is_state.push_back(model_->graph.value(ids[i]).isModelState());
  }
  for (auto& leaf : leaves) leaf.mutable_grad() = at::Tensor();
  // A piece that writes into its inputs (`buckets += ...`) runs each time on fresh copies,
  // as the runtime's micro-batches do; on the same tensors the writes would pile up (T5's
  // position buckets left the embedding's range).
  bool writes = false;
  for (ir::TaskId t : piece.tasks) writes = writes || frontend::writesInputs(*model_, t);
  const std::vector<c10::IValue> originals = writes ? inputs : std::vector<c10::IValue>();
  // [Note: weight part measured] With measure_weight_part, the first timed run splits its
  // backward as ZB-H1 runs it (frontend/split_backward.h) and times the weight part; its
  // share of that backward, applied to the median backward of the other runs, is the
  // piece's weight time. The other runs backpropagate whole, as 1F1B does: a split backward
  // of a piece whose inputs take gradients runs ~10% longer than the whole one on the CPU,
  // so the time budget waits for one whole run too (one run more than 1F1B's plans measure
  // on a piece over the budget). Only where no whole run fits `runs` does the split one's
  // backward count.
  bool has_params = false;
  for (char s : leaf_is_state) has_params = has_params || s;
  const bool measure_weight = options_.measure_weight_part && !options_.forward_only;
  std::vector<double> fwd, bwd, split_bwd;
  double weight_share = measure_weight && !has_params ? 0.0 : -1.0;  // < 0: not (yet) measured
  double spent = 0.0;
  ProfileRecord r;
  for (int run = 0; run < runs; ++run) {
    const bool weight_pending = measure_weight && has_params && weight_share < 0;
    const bool whole_pending = !options_.forward_only && bwd.empty();
    if (!fwd.empty() && options_.time_budget > 0 && spent >= options_.time_budget && !weight_pending &&
        !whole_pending) {
      break;
    }
    const bool timed = run >= options_.warmup;
    const bool split = timed && weight_pending;
    if (writes) {
      for (size_t i = 0; i < inputs.size(); ++i) {
        if (!originals[i].isTensor() || model_->graph.value(ids[i]).isModelState()) continue;
        const at::Tensor& t = originals[i].toTensor();
        if (t.defined()) inputs[i] = t.detach().clone().requires_grad_(t.requires_grad());
      }
    }
    // [Note: accumulating backward] The parameters' gradients stay from the run before,
    // so the backward adds into them as the runtime's does for all micro-batches but the
    // first (on CPU that add was ~8% of a transformer stage's backward, unseen when every
    // run started without gradients). Only the gradients this run creates are charged to
    // its peak below, and none of them: the memory model counts them (params x 2).
    int64_t fresh_grad_bytes = 0;
    for (size_t i = 0; i < leaves.size(); ++i) {
      if (!leaf_is_state[i]) {
        leaves[i].mutable_grad() = at::Tensor();
      } else if (!leaves[i].grad().defined()) {
        fresh_grad_bytes += leaves[i].numel() * leaves[i].element_size();
      }
    }
    const int64_t base = meter.current();
    meter.resetPeak();

    meter.start();
    std::vector<c10::IValue> outputs;
    {
      torch::AutoGradMode grad(!recompute && !options_.forward_only);
      outputs = frontend::runPiece(*run_model_, piece, inputs);
    }
    meter.forwardDone();
    const int64_t held = options_.forward_only ? 0 : meter.current() - base;
    if (!options_.forward_only) {
      if (recompute) {
        outputs.clear();
        torch::AutoGradMode grad(true);
        outputs = frontend::runPiece(*run_model_, piece, inputs);
      }
      std::vector<at::Tensor> roots, grads;
      for (const auto& v : outputs) {
        if (!v.isTensor()) continue;
        const at::Tensor& t = v.toTensor();
        if (!t.defined() || !t.requires_grad()) continue;
        roots.push_back(t);
        grads.push_back(at::ones_like(t));
      }
      if (split) {
        std::shared_ptr<frontend::WeightPart> weight;
        // The inputs this run read (a piece that writes its inputs ran on fresh copies).
        std::vector<at::Tensor> grad_inputs;
        for (size_t i = 0; i < inputs.size(); ++i) {
          if (inputs[i].isTensor() && !model_->graph.value(ids[i]).isModelState()) {
            grad_inputs.push_back(inputs[i].toTensor());
          }
        }
        if (!roots.empty()) frontend::backwardInputPart(roots, grads, grad_inputs, &weight);
        meter.inputPartDone();
        if (weight) frontend::backwardWeightPart(*weight);
      } else if (!roots.empty()) {
        torch::autograd::backward(roots, grads, /*retain_graph=*/false, /*create_graph=*/false);
      }
    }
    meter.backwardDone();
    const DeviceMeter::Seconds took = meter.seconds();
    const int64_t peak_abs = meter.peak();
    outputs.clear();
    // The CPU counter refuses past the limit as it happens; the CUDA allocator has no
    // byte limit, so the peak is checked here (the run itself fitted the real device).
    if (options_.memory_limit > 0 && peak_abs - limit_base > options_.memory_limit) {
      ProfileRecord over;
      over.out_of_memory = true;
      for (auto& leaf : leaves) leaf.mutable_grad() = at::Tensor();
      return over;
    }
    if (timed) {
      // Memory of the timed runs only, like their time: a warm-up run also makes what a
      // process allocates once and keeps (the cuBLAS workspace), which is no piece's.
      const int64_t peak = peak_abs - base - (options_.forward_only ? 0 : fresh_grad_bytes);
      r.activation_bytes = std::max(r.activation_bytes, held);
      r.peak_bytes = std::max(r.peak_bytes, std::max(peak, held));
      fwd.push_back(took.forward);
      if (split) {
        split_bwd.push_back(took.backward);
        weight_share = took.backward > 0 ? std::clamp(took.weight / took.backward, 0.0, 1.0) : 0.0;
      } else {
        bwd.push_back(took.backward);
      }
      spent += took.forward + took.backward;
    }
  }
  for (auto& leaf : leaves) leaf.mutable_grad() = at::Tensor();
  r.forward_time = median(fwd);
  r.backward_time = options_.forward_only ? 0.0 : median(bwd.empty() ? split_bwd : bwd);
  if (measure_weight && weight_share >= 0) r.weight_time = weight_share * r.backward_time;
  return r;
}

}  // namespace rannc::profile
