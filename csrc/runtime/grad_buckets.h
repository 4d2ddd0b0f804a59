#pragma once
// Summing the step's gradients over the ranks that share each parameter (a stage's
// replicas, and stages that share tied weights), overlapped with the last backward.
//
// [Note: bucketed all-reduce] Each gradient group (ranks, parameters) is cut into buckets
// of about `bucket_bytes`, parameters in descending value id (the order backward finishes
// them, roughly). During the stage's last backward of the step, a parameter's gradient is
// final once autograd has accumulated it (a post hook on its AccumulateGrad node, as
// DistributedDataParallel's reducer does); a bucket's all-reduce starts as soon as all its
// parameters are final and every earlier bucket has started, so every member of a group
// starts the group's all-reduces in the same order (MPI and NCCL need that) while the rest
// of the backward runs. Buckets whose parameters got no gradient start at the end.
// On CUDA autograd runs those hooks on its device thread, not the caller's: a staged (MPI)
// all-reduce started there needs MPI_THREAD_MULTIPLE, so without it every bucket starts
// in finish(), on the caller's thread.
//
// [Note: gradients reached elsewhere] A parameter that two stages read (a tied weight) may
// get a gradient from one stage only: the other reads it through a detach, or for its
// type (`torch.zeros_like(w)`). The sum over the group is then its gradient on every
// holder, and each holder steps with it; keeping .grad None where this rank's stage gave
// none (right for a stage's replicas, which run one graph) left that copy stale: a
// GPT whose head reads the embedding detached trained another model on the head's stage.
// So each bucket sums one flag per parameter besides the gradients, 1 where a rank's
// stage reached it: a parameter stays None only where no rank's did.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "comm/communicator.h"
#include "ir/value.h"

namespace rannc::runtime {

class GradBuckets {
 public:
  // `groups`: this rank's (communicator, parameter ids) pairs; `own`: id -> the parameter
  // this rank updates; `bytes`: id -> its size, from the IR (the same on every rank of a
  // group, so they cut the same buckets, also where a rank gives a parameter storage only
  // after the engine is built). Tensors on a CUDA device with an MPI communicator
  // (`staged`) go through host memory.
  GradBuckets(std::vector<std::pair<std::shared_ptr<comm::Communicator>, std::vector<ir::ValueId>>> groups,
              std::map<ir::ValueId, at::Tensor> own, const std::map<ir::ValueId, int64_t>& bytes,
              bool staged, int64_t bucket_bytes = 4 << 20);
  ~GradBuckets();

  bool empty() const { return buckets_.empty(); }
  // Right before the last backward of the step: start watching the gradients.
  void arm();
  // Stops watching (idempotent).
  void disarm();
  // After the step's backwards: starts what is left, waits, and puts the summed gradients
  // into `grads` (id -> gradient).
  void finish(std::map<ir::ValueId, at::Tensor>& grads);

 private:
  struct Bucket {
    std::shared_ptr<comm::Communicator> comm;
    std::vector<ir::ValueId> ids;
  };
  struct Launched {
    const Bucket* bucket;
    at::Tensor flat;
    comm::WorkPtr work;
  };
  void markFinal(ir::ValueId id);
  void launch(bool all);
  at::Tensor gradOf(ir::ValueId id) const;

  std::vector<Bucket> buckets_;
  std::map<ir::ValueId, at::Tensor> own_;
  bool staged_ = false;
  std::vector<Launched> launched_;
  std::set<ir::ValueId> none_here_;  // this step, no gradient from this rank's stage
  std::map<ir::ValueId, int64_t> sparse_dims_;  // [Note: sparse gradients] in grad_buckets.cpp
  std::set<ir::ValueId> ready_;
  std::vector<std::function<void()>> unhook_;  // one per armed hook
};

}  // namespace rannc::runtime
