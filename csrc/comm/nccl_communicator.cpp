// The data plane for CUDA tensors: NCCL communicators bootstrapped over MPI. Compiled only
// when the torch build has CUDA and NCCL headers are found (RANNC_HAVE_NCCL).
//
// [Note: NCCL streams] Every operation runs on the communicator's own stream after it has
// waited for the caller's current stream (so inputs are ready), marks its tensors in use on
// that stream for the caching allocator, and records an event;
// Work::wait() makes the caller's current stream wait for that event (like c10d) after
// polling it from the host with the world's failure checks and deadline, so a rank whose
// peer failed raises instead of hanging in a kernel that never completes.
// - Each communicator creates its own stream. Streams from torch's pool are shared round
//   robin (32 per device), and two communicators on one stream run in issue order: a send
//   queued behind a receive that waits on a peer's send deadlocks the GPU.
// - [Note: NCCL abort] A wait that times out, sees a peer fail, or finds an asynchronous
//   NCCL error (ncclCommGetAsyncError) aborts the communicator (ncclCommAbort) before it
//   raises: ncclCommDestroy waits for every queued kernel, and a kernel waiting on a dead
//   peer never completes, so the job would hang at exit instead of ending. A communicator
//   is destroyed cleanly only while no rank has failed.
#ifdef RANNC_HAVE_NCCL

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>

#include <ATen/cuda/CUDAEvent.h>
#include <cuda_runtime_api.h>
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

std::optional<ncclDataType_t> ncclTypeOf(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kChar: return ncclInt8;
    case at::kByte: case at::kBool: return ncclUint8;
    default: return std::nullopt;
  }
}

// The element type of a reduction, which must be NCCL's own.
ncclDataType_t ncclType(at::ScalarType t) {
  if (auto type = ncclTypeOf(t)) return *type;
  throw CommError(std::string("NCCL cannot reduce tensors of dtype ") + c10::toString(t));
}

// What a transfer that reduces nothing moves: the tensor's elements, or its bytes where
// NCCL has no such type (int16, complex: values that cross stages like any other).
struct Elements {
  size_t count;
  ncclDataType_t type;
};
Elements moved(const at::Tensor& t) {
  if (auto type = ncclTypeOf(t.scalar_type())) return {static_cast<size_t>(t.numel()), *type};
  return {static_cast<size_t>(t.numel()) * t.element_size(), ncclUint8};
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

// One NCCL communicator, shared by the works queued on it so a wait can abort it.
struct NcclHandle {
  ncclComm_t comm = nullptr;
  std::atomic<bool> aborted{false};

  // Cancels what is queued ([Note: NCCL abort]); the communicator is unusable afterwards.
  void abort() {
    if (comm && !aborted.exchange(true)) ncclCommAbort(comm);
  }
  // An asynchronous error NCCL found (a network failure, a peer that vanished), or "".
  std::string asyncError() const {
    if (!comm || aborted) return "";
    ncclResult_t rc = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &rc) != ncclSuccess) return "";
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
    if (rc == ncclInProgress) return "";
#endif
    return rc == ncclSuccess ? "" : ncclGetErrorString(rc);
  }
};

// [Note: NCCL works] A work keeps the tensors it writes (a receive's buffer, a reduction's
// tensor) until it is waited for. A send keeps nothing: its input was marked in use on the
// communication stream (recordStream), so the caching allocator reuses its memory only once
// the send has read it; keeping it would hold every micro-batch's sent activations and
// gradients until the step's end instead of until the stage drops them. An event that
// completed on a communicator aborted meanwhile (ncclCommAbort ends its queued kernels
// early) says nothing about the data: such a work fails too.
class NcclWork : public Work {
 public:
  NcclWork(std::string what, std::vector<at::Tensor> keep, int device, c10::cuda::CUDAStream stream,
           std::shared_ptr<NcclHandle> handle)
      : what_(std::move(what)), keep_(std::move(keep)), device_(device), handle_(std::move(handle)) {
    event_.record(stream);
  }

  void wait(std::optional<std::chrono::milliseconds> timeout) override {
    World& world = World::get();
    const auto deadline = std::chrono::steady_clock::now() + timeout.value_or(world.defaultTimeout());
    while (!event_.query()) {
      try {
        world.checkPeers();
        failIfBroken();
        if (std::chrono::steady_clock::now() > deadline) {
          const std::string message = "rank " + std::to_string(world.rank()) + ": " + what_ +
                                      " did not complete in time (a peer is stuck or gone)";
          world.reportFailure(message);  // [Note: a timeout is a failure] in world.cpp
          throw TimeoutError(message);
        }
      } catch (...) {
        handle_->abort();
        throw;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    failIfBroken();
    event_.block(c10::cuda::getCurrentCUDAStream(device_));
    keep_.clear();
  }

  bool isCompleted() override {
    if (!event_.query()) return false;
    failIfBroken();
    return true;
  }

 private:
  void failIfBroken() const {
    const int rank = World::get().rank();
    const std::string error = handle_->asyncError();
    if (!error.empty()) {
      throw CommError("rank " + std::to_string(rank) + ": " + what_ + " failed in NCCL: " + error);
    }
    if (handle_->aborted) {
      throw CommError("rank " + std::to_string(rank) + ": " + what_ +
                      " was cancelled: its NCCL communicator was aborted after an earlier failure");
    }
  }

  std::string what_;
  std::vector<at::Tensor> keep_;
  int device_;
  std::shared_ptr<NcclHandle> handle_;
  at::cuda::CUDAEvent event_;
};

// A stream of this communicator's own (see [Note: NCCL streams]); never destroyed, since
// the caching allocator may still record events on it for blocks freed at exit.
c10::cuda::CUDAStream ownStream(int device) {
  c10::cuda::CUDAGuard guard(device);
  int least = 0, greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest) != cudaSuccess) {
    throw CommError("could not create a CUDA stream for NCCL on device " + std::to_string(device) +
                    " (rank " + std::to_string(World::get().rank()) + ")");
  }
  return c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device));
}

class NcclCommunicator : public Communicator {
 public:
  // Collective over the members of `bootstrap` (an MPI communicator of the same ranks).
  NcclCommunicator(std::shared_ptr<Communicator> bootstrap, int device)
      : bootstrap_(std::move(bootstrap)), device_(device), stream_(ownStream(device)),
        handle_(std::make_shared<NcclHandle>()) {
    // Rank 0's id reaches the others in an all-reduce (max over zeros elsewhere), not a
    // broadcast: it completes on no rank until every member has arrived, within the world's
    // deadline and failure checks, so no rank enters ncclCommInitRank (which has no deadline)
    // while a peer is stuck or gone before it.
    // [Note: eager NCCL connections] NCCL 2.22 and later connect a collective's algorithm
    // at its first use, inside the host call and waiting for the peers. A gradient group's
    // all-reduce launched from a backward hook could then wait on the host for a peer that
    // waits for this rank's pipeline send (a tied weight's group of the first and last
    // stages): a deadlock without deadline. Connecting at init (NCCL's behaviour before
    // 2.22) avoids it; a user's own setting wins.
    setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (bootstrap_->rank() == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    at::Tensor buf = at::from_blob(&id, {static_cast<int64_t>(sizeof id)}, at::kByte).clone();
    bootstrap_->allReduce(buf, ReduceOp::Max)->wait();
    std::memcpy(&id, buf.data_ptr(), sizeof id);
    c10::cuda::CUDAGuard guard(device_);
    check(ncclCommInitRank(&handle_->comm, bootstrap_->size(), id, bootstrap_->rank()), "ncclCommInitRank");
  }

  ~NcclCommunicator() override {
    if (!handle_->comm || handle_->aborted) return;
    if (World::get().failing()) {
      handle_->abort();  // [Note: NCCL abort]
    } else {
      ncclCommDestroy(handle_->comm);
      handle_->comm = nullptr;  // a work that outlives this must not reach it
    }
  }

  int rank() const override { return bootstrap_->rank(); }
  int size() const override { return bootstrap_->size(); }
  int worldRank(int rank) const override { return bootstrap_->worldRank(rank); }

  WorkPtr send(const at::Tensor& tensor, int peer, int tag) override {
    checkCuda(tensor, "send");
    const Elements e = moved(tensor);
    return enqueue("NCCL send to " + std::to_string(worldRank(peer)), {tensor}, [&] {
      check(ncclSend(tensor.data_ptr(), e.count, e.type, peer, handle_->comm, stream_.stream()), "ncclSend");
    }, /*keep=*/false);  // [Note: NCCL works]
  }

  WorkPtr recv(at::Tensor tensor, int peer, int tag) override {
    checkCuda(tensor, "recv");
    const Elements e = moved(tensor);
    return enqueue("NCCL recv from " + std::to_string(worldRank(peer)), {tensor}, [&] {
      check(ncclRecv(tensor.data_ptr(), e.count, e.type, peer, handle_->comm, stream_.stream()), "ncclRecv");
    });
  }

  WorkPtr allReduce(at::Tensor tensor, ReduceOp op) override {
    checkCuda(tensor, "all-reduce");
    if (tensor.scalar_type() == at::kBool && op == ReduceOp::Sum) {
      throw CommError("all-reduce: a sum of bool tensors would leave bytes above 1 (reduce with Max)");
    }
    if (tensor.is_complex() && op != ReduceOp::Sum) {
      throw CommError("all-reduce: complex tensors have no order (only a sum reduces them)");
    }
    // NCCL has no complex type: a complex sum is the sum of its real and imaginary parts
    at::Tensor parts = tensor.is_complex() ? at::view_as_real(tensor) : tensor;
    return enqueue("NCCL all-reduce", {tensor}, [&] {
      check(ncclAllReduce(parts.data_ptr(), parts.data_ptr(), parts.numel(),
                          ncclType(parts.scalar_type()), ncclOp(op), handle_->comm, stream_.stream()),
            "ncclAllReduce");
    });
  }

  WorkPtr broadcast(at::Tensor tensor, int root) override {
    checkCuda(tensor, "broadcast");
    const Elements e = moved(tensor);
    return enqueue("NCCL broadcast", {tensor}, [&] {
      check(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), e.count, e.type, root, handle_->comm,
                          stream_.stream()),
            "ncclBroadcast");
    });
  }

  WorkPtr allGather(const at::Tensor& in, at::Tensor out) override {
    checkCuda(in, "all-gather");
    checkCuda(out, "all-gather");
    if (out.scalar_type() != in.scalar_type()) {
      throw CommError(std::string("all-gather: output dtype ") + c10::toString(out.scalar_type()) +
                      " differs from the input's " + c10::toString(in.scalar_type()));
    }
    if (out.numel() != in.numel() * size()) {
      throw CommError("all-gather: output must hold " + std::to_string(size()) + " x " +
                      std::to_string(in.numel()) + " elements");
    }
    const Elements e = moved(in);
    return enqueue("NCCL all-gather", {in, out}, [&] {
      check(ncclAllGather(in.data_ptr(), out.data_ptr(), e.count, e.type, handle_->comm, stream_.stream()),
            "ncclAllGather");
    });
  }

  std::shared_ptr<Communicator> subgroup(const std::vector<int>& ranks) override {
    // Bootstrapped over the MPI sub-group, so only its members take part.
    return std::make_shared<NcclCommunicator>(bootstrap_->subgroup(ranks), device_);
  }

 private:
  // `keep`: the work holds `tensors` until waited for ([Note: NCCL works]).
  template <typename F>
  WorkPtr enqueue(std::string what, std::vector<at::Tensor> tensors, F&& launch, bool keep = true) {
    if (handle_->aborted) {
      throw CommError("rank " + std::to_string(World::get().rank()) + ": " + what +
                      ": the NCCL communicator was aborted after an earlier failure");
    }
    for (const auto& t : tensors) {
      if (t.get_device() != device_) {
        throw CommError(what + ": a tensor on " + t.device().str() + ", but rank " +
                        std::to_string(World::get().rank()) + "'s NCCL communicator is on cuda:" +
                        std::to_string(device_) + " (the stage's device and the communicator's must agree)");
      }
    }
    c10::cuda::CUDAGuard guard(device_);
    // The communication stream waits for the work that produced the inputs.
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(device_));
    ready.block(stream_);
    for (const auto& t : tensors) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    }
    launch();
    if (!keep) tensors.clear();
    return std::make_shared<NcclWork>(std::move(what), std::move(tensors), device_, stream_, handle_);
  }

  std::shared_ptr<Communicator> bootstrap_;
  int device_;
  c10::cuda::CUDAStream stream_;
  std::shared_ptr<NcclHandle> handle_;
};

}  // namespace

std::shared_ptr<Communicator> worldCudaCommunicator(int device) {
  static int world_device = -1;
  static std::shared_ptr<Communicator> world = [device] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      throw CommError("no CUDA device for the NCCL data plane on rank " +
                      std::to_string(World::get().rank()));
    }
    world_device = device >= 0 ? device : World::get().localRank() % count;
    return std::make_shared<NcclCommunicator>(worldCpuCommunicator(), world_device);
  }();
  if (device >= 0 && device != world_device) {
    throw CommError("rank " + std::to_string(World::get().rank()) + " asked for NCCL on cuda:" +
                    std::to_string(device) + ", but its NCCL communicator is on cuda:" +
                    std::to_string(world_device) + " (one device per rank)");
  }
  return world;
}

}  // namespace rannc::comm

#endif  // RANNC_HAVE_NCCL
