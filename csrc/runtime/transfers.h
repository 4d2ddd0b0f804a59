#pragma once
// The transfer plan: which rows of which boundary value go from which rank to which, for
// every micro-batch of a step, as one rank sees it. Pure (no torch, no MPI): every rank
// computes the same lists from the deployment, and GoogleTest checks them without ranks.
//
// Every transfer sends the overlap of the rows a source holds and the rows a consumer
// needs ([Note: row ownership] in layout.h): this is the redistribution between stages with
// different replica counts. Values without a batch dimension go whole, from replica
// (j mod r) of the producing stage to replica j of the consumer.
//
// [Note: channels] Transfers go over channels, one per (sender, receiver, kind). A channel
// delivers in order: the n-th receive a rank posts on it gets the n-th message sent on it.
// Both sides issue each channel's transfers by (micro-batch, value id, first row), forwards
// and backwards each in ascending micro-batch order as every schedule runs them, so no
// tags are needed. NCCL point-to-point gives exactly this (one communicator per channel,
// so that a blocked receive of one kind never holds back a send of another, which would
// deadlock 1F1B); over MPI a channel is a tag.
//
// [Note: channel lanes] A rank holding several stages (interleaved schedules) runs its
// chunks' micro-batches interleaved. A value one chunk sends to two chunks of another
// rank goes out at once for each micro-batch but is taken at two different times; a
// rank's argument rows go out all at once and are taken chunk by chunk. So every pair of
// (sending chunk, receiving chunk) has a lane, a channel of its own: on it one chunk
// sends in its micro-batch order and one chunk receives in the same order.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ir/graph.h"
#include "ir/subgraph.h"
#include "runtime/layout.h"

namespace rannc::runtime {

enum class Channel : uint8_t {
  InputRows,       // rows of the model's arguments, from the rank that holds them
  Activation,      // a stage's outputs to the next stages
  Gradient,        // their gradients, back
  BatchOutput,     // rows of the model's batch outputs, to the ranks that own the rows
  OutputGradient,  // gradients of those rows from outside (fill-drain), back
  InputGradient,   // gradients of the arguments' rows, back to their owners
};
inline constexpr int kNumChannels = 6;
const char* channelName(Channel channel);

// One transfer: rows `rows` of value `value` for micro-batch `micro_batch`, from `src`
// (whose tensor starts at row `src_start`) to `dst` (whose tensor starts at `dst_start`).
// `whole`: the value has no batch dimension and goes as it is (rows unused). `lane`: the
// pair of chunks it goes between, src chunk x chunks + dst chunk (a rank's own rows of
// arguments and batch outputs count as chunk 0), so each pair has a channel of its own
// ([Note: channel lanes]); 0 with one stage per rank.
struct Transfer {
  ir::ValueId value = ir::kNoId;
  int micro_batch = 0;
  int src = 0;
  int dst = 0;
  bool whole = false;
  Rows rows;
  int64_t src_start = 0;
  int64_t dst_start = 0;
  int lane = 0;

  bool operator==(const Transfer& o) const;
  std::string str() const;  // "v12 m0 rows [0, 4) 1->2", "v7 m1 whole 0->3"
};

struct ChannelKey {
  int src = 0;
  int dst = 0;
  Channel channel = Channel::Activation;
  int lane = 0;  // [Note: channel lanes]
  auto operator<=>(const ChannelKey&) const = default;
};

// Lists keyed by value id, each in channel order.
using TransfersByValue = std::map<ir::ValueId, std::vector<Transfer>>;

struct TransferPlan {
  int rank = 0;
  int stage = -1;  // the stage of the rank this plan is for; -1: every stage of the rank
  std::vector<TransfersByValue> recv;     // [m]: inputs of this rank's stage, into this rank
  // [m]: this rank's outputs to later stages; with `stage` >= 0 also those to later
  // stages of this rank (src == dst == rank: read where they are, never sent)
  std::vector<TransfersByValue> send;
  std::vector<Transfer> input_sends;      // rows of this rank's arguments other ranks run
  TransfersByValue out_recv;              // rows of batch outputs this rank owns
  std::vector<TransfersByValue> out_send; // [m]: rows of batch outputs this rank produced

  // The device channels (not the arguments' rows, which travel over MPI) this rank uses,
  // ascending; both ends of a channel list it.
  std::vector<ChannelKey> deviceChannels(const ir::Graph& graph) const;
};

// Names the task that produced a value, for messages ("aten::size in encoder.0 (x.py:3)").
using DescribeTask = std::function<std::string(ir::TaskId)>;

// Whether a stage computes `value` from its own rows instead of receiving it: sizes and
// shapes ([Note: shape values] in ir/value.h).
bool isShapeValue(const ir::Value& value);

// The inputs of stage `stage` (its piece) that move between ranks: not state, not
// constants, not shape values. Throws rannc::Error for a value that is not a tensor.
std::vector<ir::ValueId> movedInputs(const ir::Graph& graph, const ir::Subgraph& piece, int stage,
                                     const DescribeTask& describe);

// The transfers of one step as `rank` sees them; `pieces[s]` is stage s's piece. With
// `stage` >= 0 (a rank holding several stages), those of that stage only: what it
// receives and sends; the rows of the rank's arguments and of the batch outputs it owns go
// with its first stage.
TransferPlan planTransfers(const ir::Graph& graph, const std::vector<ir::Subgraph>& pieces,
                           const Layout& layout, int rank, const DescribeTask& describe, int stage = -1);

// For every parameter a stage uses, the ranks whose stages use it: their gradients are
// summed (a stage's replicas, and the stages sharing a tied weight). Groups of the same
// ranks merged, ascending by ranks, value ids ascending.
std::vector<std::pair<std::vector<int>, std::vector<ir::ValueId>>> gradientGroups(
    const std::vector<ir::Subgraph>& pieces, const Layout& layout,
    const std::vector<ir::ValueId>& state_ids);

}  // namespace rannc::runtime
