#include "runtime/channels.h"

#include <map>
#include <tuple>

#include "comm/nccl_communicator.h"
#include "comm/world.h"
#include "common/error.h"

namespace rannc::runtime {
namespace {

constexpr int kTagBase = 100;  // a channel's MPI tag is kTagBase + its kind + kNumChannels x lane

class StagedWork : public comm::Work {
 public:
  StagedWork(comm::WorkPtr work, at::Tensor host, at::Tensor target)
      : work_(std::move(work)), host_(std::move(host)), target_(std::move(target)) {}
  void wait(std::optional<std::chrono::milliseconds> timeout) override {
    work_->wait(timeout);
    target_.copy_(host_, /*non_blocking=*/true);
  }
  bool isCompleted() override { return work_->isCompleted(); }

 private:
  comm::WorkPtr work_;
  at::Tensor host_, target_;
};

at::Tensor hostLike(const at::Tensor& t) {
  return at::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(t.is_cuda()));
}

class MpiChannels : public Channels {
 public:
  MpiChannels() : comm_(comm::worldCpuCommunicator()) {}
  comm::WorkPtr send(const at::Tensor& t, int dst, Channel channel, int lane) override {
    return comm_->send(t.is_cpu() ? t : t.to(c10::kCPU), dst, tag(channel, lane));
  }
  comm::WorkPtr recv(at::Tensor buffer, int src, Channel channel, int lane) override {
    if (buffer.is_cpu()) return comm_->recv(buffer, src, tag(channel, lane));
    at::Tensor host = hostLike(buffer);
    return stagedThroughHost(comm_->recv(host, src, tag(channel, lane)), host, buffer);
  }

 private:
  static int tag(Channel c, int lane) { return kTagBase + static_cast<int>(c) + kNumChannels * lane; }
  std::shared_ptr<comm::Communicator> comm_;
};

#ifdef RANNC_HAVE_NCCL
// [Note: NCCL warm-up] NCCL connects the two ends of a send/recv (and may connect a
// collective) on its first use, inside the host call, waiting for the peer's first call
// on that communicator. In a step that first use can deadlock: two ranks that each send
// to the other before receiving (the outputs and output gradients of replicated stages
// cross that way) block in their sends, each waiting for a receive the other has not
// reached. So each communicator moves one element as soon as it is made, while both ends
// are in its creation anyway.
void warmUpPair(comm::Communicator& c, bool sender, c10::Device device) {
  at::Tensor one = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  const int other = 1 - c.rank();
  (sender ? c.send(one, other, 0) : c.recv(one, other, 0))->wait();
}

void warmUpGroup(comm::Communicator& c, c10::Device device) {
  c.allReduce(at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device)))->wait();
}

std::map<ChannelKey, std::shared_ptr<comm::Communicator>>& ncclPairs() {
  static std::map<ChannelKey, std::shared_ptr<comm::Communicator>> pairs;
  return pairs;
}

class NcclChannels : public Channels {
 public:
  NcclChannels(const std::vector<ChannelKey>& keys, c10::Device device) : device_(device) {
    auto world = comm::worldCudaCommunicator(device.index());
    me_ = comm::World::get().rank();
    for (const auto& k : keys) {
      if (k.src == k.dst || (k.src != me_ && k.dst != me_)) continue;
      auto& pair = ncclPairs()[k];
      if (!pair) {
        pair = world->subgroup(k.src < k.dst ? std::vector<int>{k.src, k.dst} : std::vector<int>{k.dst, k.src});
        warmUpPair(*pair, k.src == me_, device_);  // [Note: NCCL warm-up]
      }
      comms_[k] = pair;
    }
  }
  comm::WorkPtr send(const at::Tensor& t, int dst, Channel channel, int lane) override {
    auto& c = find({me_, dst, channel, lane});
    return c->send(t.to(device_).contiguous(), peer(*c, dst), 0);
  }
  comm::WorkPtr recv(at::Tensor buffer, int src, Channel channel, int lane) override {
    auto& c = find({src, me_, channel, lane});
    return c->recv(buffer, peer(*c, src), 0);
  }

 private:
  static int peer(const comm::Communicator& c, int world_rank) { return c.worldRank(0) == world_rank ? 0 : 1; }
  std::shared_ptr<comm::Communicator>& find(const ChannelKey& k) {
    auto it = comms_.find(k);
    RANNC_CHECK(it != comms_.end(), "no NCCL channel " << k.src << "->" << k.dst << " ("
                                                       << channelName(k.channel) << " lane " << k.lane << ")");
    return it->second;
  }
  c10::Device device_;
  int me_ = 0;
  std::map<ChannelKey, std::shared_ptr<comm::Communicator>> comms_;
};
#endif

}  // namespace

comm::WorkPtr stagedThroughHost(comm::WorkPtr work, at::Tensor host, at::Tensor target) {
  return std::make_shared<StagedWork>(std::move(work), std::move(host), std::move(target));
}

std::unique_ptr<Channels> mpiChannels() { return std::make_unique<MpiChannels>(); }

std::unique_ptr<Channels> ncclChannels(const std::vector<ChannelKey>& keys, c10::Device device) {
#ifdef RANNC_HAVE_NCCL
  return std::make_unique<NcclChannels>(keys, device);
#else
  (void)keys;
  (void)device;
  throw CommError("this build of rannc has no NCCL data plane (it was built against a torch "
                  "without CUDA, or NCCL was not found)");
#endif
}

std::shared_ptr<comm::Communicator> groupCommunicator(const std::vector<int>& ranks, bool nccl,
                                                      c10::Device device) {
  // One per group for the process: the engines of every mode and input shape of a plan
  // ([Note: new input shapes] in python/rannc/deployed.py) have the same gradient groups, and
  // an NCCL communicator holds device memory. Every rank creates engines in the same order,
  // so the members of a group all find it here or all create it together.
  using Key = std::tuple<std::vector<int>, bool, int>;
  static std::map<Key, std::shared_ptr<comm::Communicator>> groups;
  auto& group = groups[Key{ranks, nccl, nccl ? device.index() : -1}];
  if (group) return group;
#ifdef RANNC_HAVE_NCCL
  if (nccl) {
    group = comm::worldCudaCommunicator(device.index())->subgroup(ranks);
    warmUpGroup(*group, device);  // [Note: NCCL warm-up]
    return group;
  }
#else
  (void)device;
  RANNC_CHECK(!nccl, "NCCL asked for in a build without it");
#endif
  group = comm::worldCpuCommunicator()->subgroup(ranks);
  return group;
}

}  // namespace rannc::runtime
