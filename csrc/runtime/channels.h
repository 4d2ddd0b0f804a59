#pragma once
// The engine's point-to-point transfers over channels ([Note: channels] in transfers.h):
// over MPI a channel is a tag (tensors on a CUDA device go through host memory); over NCCL
// it is a two-rank communicator of its own.
#include <map>
#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include "comm/communicator.h"
#include "runtime/transfers.h"

namespace rannc::runtime {

class Channels {
 public:
  virtual ~Channels() = default;
  // `lane`: [Note: channel lanes] in transfers.h.
  virtual comm::WorkPtr send(const at::Tensor& tensor, int dst, Channel channel, int lane = 0) = 0;
  // wait() leaves the data in `buffer`.
  virtual comm::WorkPtr recv(at::Tensor buffer, int src, Channel channel, int lane = 0) = 0;
};

// Channels over MPI (the world's CPU communicator).
std::unique_ptr<Channels> mpiChannels();

// Channels over NCCL for `keys` (this rank's device channels, ascending; collective over
// each pair: both ends list the channel and create it in the same order). Two-rank
// communicators are created once per process and shared by every engine; each is warmed
// up with a one-element transfer as it is made ([Note: NCCL warm-up] in channels.cpp).
// Throws CommError where the build has no NCCL.
std::unique_ptr<Channels> ncclChannels(const std::vector<ChannelKey>& keys, c10::Device device);

// An MPI operation on a host copy of a device tensor: wait() finishes it and copies the
// host data into `target` (receives and all-reduces of CUDA tensors over MPI).
comm::WorkPtr stagedThroughHost(comm::WorkPtr work, at::Tensor host, at::Tensor target);

// The communicator that all-reduces gradients among `ranks` (ascending, this rank among
// them; collective over them the first time, then shared by every engine that asks): NCCL
// on `device` for CUDA stages where `nccl` (warmed up as it is made), else MPI (CUDA
// tensors then go through host memory: GradBuckets stages them).
std::shared_ptr<comm::Communicator> groupCommunicator(const std::vector<int>& ranks, bool nccl,
                                                      c10::Device device);

}  // namespace rannc::runtime
