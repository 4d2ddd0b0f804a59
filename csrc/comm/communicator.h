#pragma once
// The data plane: one interface for moving tensors between ranks, with async handles.
// MpiCommunicator moves CPU tensors; an NCCL implementation (CUDA tensors) plugs in behind
// the same interface when the build has CUDA and NCCL.
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace rannc::comm {

enum class ReduceOp { Sum, Max, Min };

// An operation in flight. Keeps its tensors alive until it completes.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation completes (and results are in place); throws CommError
  // naming the op, the peer and this rank, or TimeoutError after `timeout` (default:
  // the world's). A peer's reported failure is rethrown here.
  virtual void wait(std::optional<std::chrono::milliseconds> timeout = std::nullopt) = 0;
  // Non-blocking completion test (does not finish copies: call wait).
  virtual bool isCompleted() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // rank within this communicator
  virtual int size() const = 0;
  // World rank of a member of this communicator.
  virtual int worldRank(int rank) const = 0;

  // Point-to-point; `tag` separates concurrent transfers between the same pair.
  virtual WorkPtr send(const at::Tensor& tensor, int peer, int tag) = 0;
  // Receives into `tensor` (its shape and dtype must match what is sent).
  virtual WorkPtr recv(at::Tensor tensor, int peer, int tag) = 0;

  // Collectives: every member calls them in the same order.
  virtual WorkPtr allReduce(at::Tensor tensor, ReduceOp op = ReduceOp::Sum) = 0;
  virtual WorkPtr broadcast(at::Tensor tensor, int root) = 0;
  // `out` holds size() blocks shaped like `in`, stacked along dimension 0, rank order.
  virtual WorkPtr allGather(const at::Tensor& in, at::Tensor out) = 0;

  // A communicator over `ranks` (ranks of this communicator, ascending). Collective over
  // the members of `ranks` only; others must not call it for this group.
  virtual std::shared_ptr<Communicator> subgroup(const std::vector<int>& ranks) = 0;
};

// The communicator of all ranks for CPU tensors (MPI).
std::shared_ptr<Communicator> worldCpuCommunicator();

}  // namespace rannc::comm
