// The data plane for CUDA tensors: NCCL communicators bootstrapped over MPI. Compiled only
// when the torch build has CUDA and NCCL headers are found (RANNC_HAVE_NCCL).
//
// [Note: NCCL streams] Every operation runs on the communicator's own stream after it has
// waited for the caller's current stream (so inputs are ready), and records an event;
// Work::wait() makes the caller's current stream wait for that event (like c10d) after
// polling it from the host with the world's failure checks and deadline, so a rank whose
// peer failed raises instead of hanging in a kernel that never completes.
#ifdef RANNC_HAVE_NCCL

#include <chrono>
#include <thread>

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include "comm/communicator.h"
#include "comm/nccl_communicator.h"
#include "comm/world.h"
#include "common/error.h"

namespace rannc::comm {
namespace {

void check(ncclResult_t rc, const std::string& what) {
  if (rc != ncclSuccess) {
    throw CommError(what + " failed on rank " + std::to_string(World::get().rank()) + ": " +
                    ncclGetErrorString(rc));
  }
}

ncclDataType_t ncclType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kChar: return ncclInt8;
    case at::kByte: case at::kBool: return ncclUint8;
    default:
      throw CommError(std::string("NCCL cannot move tensors of dtype ") + c10::toString(t));
  }
}

ncclRedOp_t ncclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

void checkCuda(const at::Tensor& t, const char* op) {
  if (!t.is_cuda()) {
    throw CommError(std::string(op) + ": the NCCL data plane moves CUDA tensors, got one on " +
                    t.device().str());
  }
  if (!t.is_contiguous()) throw CommError(std::string(op) + ": NCCL needs contiguous tensors");
}

class NcclWork : public Work {
 public:
  NcclWork(std::string what, std::vector<at::Tensor> keep, c10::cuda::CUDAStream stream)
      : what_(std::move(what)), keep_(std::move(keep)) {
    event_.record(stream);
  }

  void wait(std::optional<std::chrono::milliseconds> timeout) override {
    World& world = World::get();
    const auto deadline = std::chrono::steady_clock::now() + timeout.value_or(world.defaultTimeout());
    while (!event_.query()) {
      world.checkPeers();
      if (std::chrono::steady_clock::now() > deadline) {
        throw TimeoutError("rank " + std::to_string(world.rank()) + ": " + what_ +
                           " did not complete in time (a peer is stuck or gone)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    event_.block(c10::cuda::getCurrentCUDAStream(keep_.empty() ? 0 : keep_[0].get_device()));
    keep_.clear();
  }

  bool isCompleted() override { return event_.query(); }

 private:
  std::string what_;
  std::vector<at::Tensor> keep_;
  at::cuda::CUDAEvent event_;
};

class NcclCommunicator : public Communicator {
 public:
  // Collective over the members of `bootstrap` (an MPI communicator of the same ranks).
  NcclCommunicator(std::shared_ptr<Communicator> bootstrap, int device)
      : bootstrap_(std::move(bootstrap)), device_(device),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)) {
    ncclUniqueId id;
    if (bootstrap_->rank() == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    at::Tensor buf = at::from_blob(&id, {static_cast<int64_t>(sizeof id)}, at::kByte).clone();
    bootstrap_->broadcast(buf, 0)->wait();
    std::memcpy(&id, buf.data_ptr(), sizeof id);
    c10::cuda::CUDAGuard guard(device_);
    check(ncclCommInitRank(&comm_, bootstrap_->size(), id, bootstrap_->rank()), "ncclCommInitRank");
  }

  ~NcclCommunicator() override {
    if (comm_) ncclCommDestroy(comm_);
  }

  int rank() const override { return bootstrap_->rank(); }
  int size() const override { return bootstrap_->size(); }
  int worldRank(int rank) const override { return bootstrap_->worldRank(rank); }

  WorkPtr send(const at::Tensor& tensor, int peer, int tag) override {
    checkCuda(tensor, "send");
    return enqueue("NCCL send to " + std::to_string(worldRank(peer)), {tensor}, [&] {
      check(ncclSend(tensor.data_ptr(), tensor.numel(), ncclType(tensor.scalar_type()), peer, comm_,
                     stream_.stream()),
            "ncclSend");
    });
  }

  WorkPtr recv(at::Tensor tensor, int peer, int tag) override {
    checkCuda(tensor, "recv");
    return enqueue("NCCL recv from " + std::to_string(worldRank(peer)), {tensor}, [&] {
      check(ncclRecv(tensor.data_ptr(), tensor.numel(), ncclType(tensor.scalar_type()), peer, comm_,
                     stream_.stream()),
            "ncclRecv");
    });
  }

  WorkPtr allReduce(at::Tensor tensor, ReduceOp op) override {
    checkCuda(tensor, "all-reduce");
    return enqueue("NCCL all-reduce", {tensor}, [&] {
      check(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                          ncclType(tensor.scalar_type()), ncclOp(op), comm_, stream_.stream()),
            "ncclAllReduce");
    });
  }

  WorkPtr broadcast(at::Tensor tensor, int root) override {
    checkCuda(tensor, "broadcast");
    return enqueue("NCCL broadcast", {tensor}, [&] {
      check(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                          ncclType(tensor.scalar_type()), root, comm_, stream_.stream()),
            "ncclBroadcast");
    });
  }

  WorkPtr allGather(const at::Tensor& in, at::Tensor out) override {
    checkCuda(in, "all-gather");
    checkCuda(out, "all-gather");
    if (out.numel() != in.numel() * size()) {
      throw CommError("all-gather: output must hold " + std::to_string(size()) + " x " +
                      std::to_string(in.numel()) + " elements");
    }
    return enqueue("NCCL all-gather", {in, out}, [&] {
      check(ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), ncclType(in.scalar_type()),
                          comm_, stream_.stream()),
            "ncclAllGather");
    });
  }

  std::shared_ptr<Communicator> subgroup(const std::vector<int>& ranks) override {
    // Bootstrapped over the MPI sub-group, so only its members take part.
    return std::make_shared<NcclCommunicator>(bootstrap_->subgroup(ranks), device_);
  }

 private:
  template <typename F>
  WorkPtr enqueue(std::string what, std::vector<at::Tensor> tensors, F&& launch) {
    c10::cuda::CUDAGuard guard(device_);
    // The communication stream waits for the work that produced the inputs.
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(device_));
    ready.block(stream_);
    for (const auto& t : tensors) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    }
    launch();
    return std::make_shared<NcclWork>(std::move(what), std::move(tensors), stream_);
  }

  std::shared_ptr<Communicator> bootstrap_;
  int device_;
  c10::cuda::CUDAStream stream_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

std::shared_ptr<Communicator> worldCudaCommunicator() {
  static std::shared_ptr<Communicator> world = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      throw CommError("no CUDA device for the NCCL data plane on rank " +
                      std::to_string(World::get().rank()));
    }
    return std::make_shared<NcclCommunicator>(worldCpuCommunicator(),
                                              World::get().localRank() % count);
  }();
  return world;
}

}  // namespace rannc::comm

#endif  // RANNC_HAVE_NCCL
