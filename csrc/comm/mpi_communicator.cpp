#include <functional>
#include <mutex>

#include <mpi.h>

#include "comm/communicator.h"
#include "comm/world.h"
#include "common/error.h"

namespace rannc::comm {
namespace {

MPI_Datatype mpiType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    case at::kShort: return MPI_INT16_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBool: return MPI_C_BOOL;
    case at::kHalf: case at::kBFloat16: return MPI_UINT16_T;  // moved as bits, never reduced
    // an FFT layer's complex weights and activations (a Fourier neural operator); MPI sums them
    case at::kComplexFloat: return MPI_C_FLOAT_COMPLEX;
    case at::kComplexDouble: return MPI_C_DOUBLE_COMPLEX;
    default:
      throw CommError(std::string("MPI cannot move tensors of dtype ") + c10::toString(t));
  }
}

MPI_Op mpiOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return MPI_SUM;
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  return MPI_SUM;
}

void checkCpu(const at::Tensor& t, const char* op) {
  if (!t.device().is_cpu()) {
    throw CommError(std::string(op) + ": the MPI data plane moves CPU tensors, got one on " +
                    t.device().str());
  }
}

class MpiWork : public Work {
 public:
  MpiWork(std::string what, std::vector<at::Tensor> keep, std::function<void()> finish)
      : what_(std::move(what)), keep_(std::move(keep)), finish_(std::move(finish)) {
    World::get().beginOperation();
  }
  ~MpiWork() override {
    if (done_) return;
    World::get().endOperation();
    if (request_ != MPI_REQUEST_NULL) {
      // A wait cut short (a failure, a timeout) leaves the operation in flight: MPI may
      // still write its buffers (the progress thread, a later MPI call), so they stay
      // allocated until exit ([Note: failures stay] in world.cpp; freeing them corrupted
      // the heap of a script that caught the error and went on). The request stays too:
      // freeing a collective's request is erroneous in MPI.
      static std::mutex mutex;
      static auto* abandoned = new std::vector<at::Tensor>();  // never destroyed
      std::lock_guard<std::mutex> lock(mutex);
      abandoned->insert(abandoned->end(), keep_.begin(), keep_.end());
    }
  }

  MPI_Request* request() { return &request_; }

  // A receive checks that the message filled its buffer: transfers matched by order
  // (the pipeline's channels, runtime/channels.h) must never pair a message with another's buffer.
  void expect(int count, MPI_Datatype type) {
    expected_ = count;
    type_ = type;
  }

  void wait(std::optional<std::chrono::milliseconds> timeout) override {
    if (done_) return;
    World& world = World::get();
    MPI_Status status;
    world.wait(request_, what_, timeout.value_or(world.defaultTimeout()), &status);
    complete(status);
  }

  bool isCompleted() override {
    if (done_) return true;
    int flag = 0;
    MPI_Status status;
    MPI_Test(&request_, &flag, &status);
    if (flag) complete(status);
    return done_;
  }

 private:
  void complete(const MPI_Status& status) {
    done_ = true;
    if (expected_ >= 0) {
      int got = 0;
      MPI_Get_count(&status, type_, &got);
      if (got != expected_) {
        World::get().endOperation();
        keep_.clear();
        throw CommError(what_ + ": received " + std::to_string(got) + " elements into a buffer of " +
                        std::to_string(expected_) + " (sender and receiver disagree on the transfer)");
      }
    }
    World::get().endOperation();
    if (finish_) finish_();
    keep_.clear();
  }

  std::string what_;
  std::vector<at::Tensor> keep_;
  std::function<void()> finish_;
  MPI_Request request_ = MPI_REQUEST_NULL;
  bool done_ = false;
  int expected_ = -1;
  MPI_Datatype type_ = MPI_BYTE;
};

void check(int rc, const std::string& what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw CommError(what + " failed: " + std::string(msg, len));
  }
}

int count(const at::Tensor& t) {
  if (t.numel() > std::numeric_limits<int>::max()) {
    throw CommError("tensor of " + std::to_string(t.numel()) + " elements is too large for one MPI message");
  }
  return static_cast<int>(t.numel());
}

class MpiCommunicator : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Group group, world_group;
    MPI_Comm_group(comm_, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    std::vector<int> mine(size_), world(size_);
    for (int i = 0; i < size_; ++i) mine[i] = i;
    MPI_Group_translate_ranks(group, size_, mine.data(), world_group, world.data());
    world_ranks_ = world;
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int worldRank(int rank) const override { return world_ranks_.at(rank); }

  WorkPtr send(const at::Tensor& tensor, int peer, int tag) override {
    checkCpu(tensor, "send");
    at::Tensor t = tensor.contiguous();
    auto work = std::make_shared<MpiWork>(describe("send", peer, tag), std::vector<at::Tensor>{t},
                                          nullptr);
    check(MPI_Isend(t.data_ptr(), count(t), mpiType(t.scalar_type()), peer, tag, comm_,
                    work->request()),
          describe("send", peer, tag));
    return work;
  }

  WorkPtr recv(at::Tensor tensor, int peer, int tag) override {
    checkCpu(tensor, "recv");
    at::Tensor buf = tensor.is_contiguous() ? tensor : at::empty_like(tensor, at::MemoryFormat::Contiguous);
    std::function<void()> finish;
    if (!buf.is_same(tensor)) finish = [tensor, buf]() mutable { tensor.copy_(buf); };
    auto work = std::make_shared<MpiWork>(describe("recv", peer, tag),
                                          std::vector<at::Tensor>{tensor, buf}, finish);
    work->expect(count(buf), mpiType(buf.scalar_type()));
    check(MPI_Irecv(buf.data_ptr(), count(buf), mpiType(buf.scalar_type()), peer, tag, comm_,
                    work->request()),
          describe("recv", peer, tag));
    return work;
  }

  WorkPtr allReduce(at::Tensor tensor, ReduceOp op) override {
    checkCpu(tensor, "all-reduce");
    if (tensor.is_complex() && op != ReduceOp::Sum) {
      throw CommError("all-reduce: complex tensors have no order (only a sum reduces them)");
    }
    // Half precision is reduced in float: MPI has no 16-bit float type.
    const bool widen = tensor.scalar_type() == at::kHalf || tensor.scalar_type() == at::kBFloat16;
    at::Tensor buf = widen ? tensor.to(at::kFloat) : tensor.contiguous();
    std::function<void()> finish;
    if (!buf.is_same(tensor)) finish = [tensor, buf]() mutable { tensor.copy_(buf); };
    auto work = std::make_shared<MpiWork>(describe("all-reduce", -1, 0),
                                          std::vector<at::Tensor>{tensor, buf}, finish);
    check(MPI_Iallreduce(MPI_IN_PLACE, buf.data_ptr(), count(buf), mpiType(buf.scalar_type()),
                         mpiOp(op), comm_, work->request()),
          describe("all-reduce", -1, 0));
    return work;
  }

  WorkPtr broadcast(at::Tensor tensor, int root) override {
    checkCpu(tensor, "broadcast");
    at::Tensor buf = tensor.contiguous();
    std::function<void()> finish;
    if (!buf.is_same(tensor)) finish = [tensor, buf]() mutable { tensor.copy_(buf); };
    auto work = std::make_shared<MpiWork>(describe("broadcast", root, 0),
                                          std::vector<at::Tensor>{tensor, buf}, finish);
    check(MPI_Ibcast(buf.data_ptr(), count(buf), mpiType(buf.scalar_type()), root, comm_,
                     work->request()),
          describe("broadcast", root, 0));
    return work;
  }

  WorkPtr allGather(const at::Tensor& in, at::Tensor out) override {
    checkCpu(in, "all-gather");
    checkCpu(out, "all-gather");
    if (out.numel() != in.numel() * size_ || out.scalar_type() != in.scalar_type()) {
      throw CommError("all-gather: output must hold " + std::to_string(size_) + " x " +
                      std::to_string(in.numel()) + " elements of the input's dtype");
    }
    at::Tensor src = in.contiguous();
    at::Tensor buf = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
    std::function<void()> finish;
    if (!buf.is_same(out)) finish = [out, buf]() mutable { out.copy_(buf); };
    auto work = std::make_shared<MpiWork>(describe("all-gather", -1, 0),
                                          std::vector<at::Tensor>{src, out, buf}, finish);
    check(MPI_Iallgather(src.data_ptr(), count(src), mpiType(src.scalar_type()), buf.data_ptr(),
                         count(src), mpiType(src.scalar_type()), comm_, work->request()),
          describe("all-gather", -1, 0));
    return work;
  }

  std::shared_ptr<Communicator> subgroup(const std::vector<int>& ranks) override {
    MPI_Group group, sub;
    MPI_Comm_group(comm_, &group);
    MPI_Group_incl(group, static_cast<int>(ranks.size()), ranks.data(), &sub);
    MPI_Comm comm;
    // Collective over the group's members only (MPI-3).
    check(MPI_Comm_create_group(comm_, sub, /*tag=*/4242, &comm), "creating a sub-communicator");
    MPI_Group_free(&group);
    MPI_Group_free(&sub);
    if (comm == MPI_COMM_NULL) {
      throw CommError("rank " + std::to_string(World::get().rank()) +
                      " asked for a sub-communicator it is not a member of");
    }
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    return std::make_shared<MpiCommunicator>(comm);
  }

 private:
  std::string describe(const char* op, int peer, int tag) const {
    std::string s = std::string("MPI ") + op + " on rank " + std::to_string(World::get().rank());
    if (peer >= 0) s += ", peer " + std::to_string(worldRank(peer)) + ", tag " + std::to_string(tag);
    return s;
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;
};

}  // namespace

std::shared_ptr<Communicator> worldCpuCommunicator() {
  static std::shared_ptr<Communicator> world =
      std::make_shared<MpiCommunicator>(World::get().dataComm());
  return world;
}

}  // namespace rannc::comm
