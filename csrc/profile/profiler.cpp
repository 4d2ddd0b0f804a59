#include "profile/profiler.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "common/error.h"
#include "frontend/interpreter.h"
#include "partition/cost/cost_model.h"
#include "profile/memory_counter.h"

namespace rannc::profile {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

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

Profiler::Profiler(std::shared_ptr<const frontend::TracedModel> model,
                   std::shared_ptr<const BoundaryInputs> inputs, ProfilerOptions options)
    : model_(std::move(model)), inputs_(std::move(inputs)), options_(options) {
  if (options_.repetitions < 1) throw Error("profiling needs at least one repetition");
  if (options_.warmup < 0) throw Error("profiling warm-up runs cannot be negative");
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
  r.backward_time = 2.0 * fwd + (recompute ? fwd : 0.0);
  return r;
}

ProfileRecord Profiler::measure(const ir::Subgraph& piece, int64_t rows, bool recompute) {
  RANNC_CHECK(rows >= 1, "profiling at " << rows << " rows");
  MemoryCounter& counter = MemoryCounter::get();
  MemoryCounter::Scope scope;
  const int64_t saved_limit = counter.limit();
  const int64_t refusals = counter.refusals();
  ProfileRecord r;
  try {
    // The limit counts what the piece allocates on top of what is live now.
    counter.setLimit(options_.memory_limit > 0 ? counter.current() + options_.memory_limit : 0);
    r = measureOnce(piece, rows, recompute, options_.warmup + options_.repetitions);
  } catch (const c10::OutOfMemoryError&) {
    r = ProfileRecord();
    r.out_of_memory = true;
  } catch (const std::bad_alloc&) {
    r = ProfileRecord();
    r.out_of_memory = true;
  } catch (...) {
    counter.setLimit(saved_limit);
    // The interpreter wraps the allocator's error in one naming the op.
    if (counter.refusals() == refusals) throw;
    r = ProfileRecord();
    r.out_of_memory = true;
  }
  counter.setLimit(saved_limit);
  if (r.out_of_memory) {
    r.forward_time = r.backward_time = std::numeric_limits<double>::infinity();
    r.activation_bytes = r.peak_bytes = std::max<int64_t>(options_.memory_limit, 1) + 1;
    return r;
  }
  if (options_.fake_timer) {
    ProfileRecord fake = fakeTimes(piece, rows, recompute);
    r.forward_time = fake.forward_time;
    r.backward_time = fake.backward_time;
  }
  return r;
}

ProfileRecord Profiler::measureOnce(const ir::Subgraph& piece, int64_t rows, bool recompute,
                                    int runs) {
  MemoryCounter& counter = MemoryCounter::get();
  std::vector<c10::IValue> inputs = inputs_->make(piece, rows);
  // The parameters' gradients are charged by the planner's memory model (params x 2).
  int64_t state_grad_bytes = 0;
  std::vector<at::Tensor> leaves;
  const auto ids = frontend::runPieceInputs(*model_, piece);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].isTensor()) continue;
    const at::Tensor& t = inputs[i].toTensor();
    if (!t.defined() || !t.requires_grad()) continue;
    leaves.push_back(t);
    if (model_->graph.value(ids[i]).isModelState()) state_grad_bytes += tensorBytes(inputs[i]);
  }
  std::vector<double> fwd, bwd;
  double spent = 0.0;
  ProfileRecord r;
  for (int run = 0; run < runs; ++run) {
    if (!fwd.empty() && options_.time_budget > 0 && spent >= options_.time_budget) break;
    const bool timed = run >= options_.warmup;
    for (auto& leaf : leaves) leaf.mutable_grad() = at::Tensor();
    const int64_t base = counter.current();
    counter.resetPeak();

    auto t0 = Clock::now();
    std::vector<c10::IValue> outputs;
    {
      torch::AutoGradMode grad(!recompute);
      outputs = frontend::runPiece(*model_, piece, inputs);
    }
    auto t1 = Clock::now();
    const int64_t held = counter.current() - base;

    double backward = 0.0;
    {
      auto b0 = Clock::now();
      if (recompute) {
        outputs.clear();
        torch::AutoGradMode grad(true);
        outputs = frontend::runPiece(*model_, piece, inputs);
      }
      std::vector<at::Tensor> roots, grads;
      for (const auto& v : outputs) {
        if (!v.isTensor()) continue;
        const at::Tensor& t = v.toTensor();
        if (!t.defined() || !t.requires_grad()) continue;
        roots.push_back(t);
        grads.push_back(at::ones_like(t));
      }
      if (!roots.empty()) {
        torch::autograd::backward(roots, grads, /*retain_graph=*/false, /*create_graph=*/false);
      }
      backward = seconds(b0, Clock::now());
    }
    const int64_t peak = counter.peak() - base - state_grad_bytes;
    outputs.clear();
    r.activation_bytes = std::max(r.activation_bytes, held);
    r.peak_bytes = std::max(r.peak_bytes, std::max(peak, held));
    if (timed) {
      fwd.push_back(seconds(t0, t1));
      bwd.push_back(backward);
      spent += fwd.back() + backward;
    }
  }
  for (auto& leaf : leaves) leaf.mutable_grad() = at::Tensor();
  r.forward_time = median(fwd);
  r.backward_time = median(bwd);
  return r;
}

}  // namespace rannc::profile
