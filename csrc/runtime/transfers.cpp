#include "runtime/transfers.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "common/error.h"

namespace rannc::runtime {

const char* channelName(Channel channel) {
  switch (channel) {
    case Channel::InputRows: return "input-rows";
    case Channel::Activation: return "activation";
    case Channel::Gradient: return "gradient";
    case Channel::BatchOutput: return "batch-output";
    case Channel::OutputGradient: return "output-gradient";
    case Channel::InputGradient: return "input-gradient";
  }
  return "?";
}

bool Transfer::operator==(const Transfer& o) const {
  return value == o.value && micro_batch == o.micro_batch && src == o.src && dst == o.dst &&
         whole == o.whole && rows == o.rows && src_start == o.src_start && dst_start == o.dst_start &&
         lane == o.lane;
}

std::string Transfer::str() const {
  std::ostringstream os;
  os << "v" << value << " m" << micro_batch << " ";
  if (whole) {
    os << "whole";
  } else {
    os << "rows " << rows.str();
  }
  os << " " << src << "->" << dst;
  if (lane > 0) os << " lane " << lane;
  return os.str();
}

namespace {

// [Note: channels]: each channel's transfers in one order on both sides.
void sortChannelOrder(std::vector<Transfer>& transfers) {
  std::stable_sort(transfers.begin(), transfers.end(), [](const Transfer& a, const Transfer& b) {
    auto key = [](const Transfer& t) {
      return std::make_tuple(t.micro_batch, t.value, t.whole ? int64_t(0) : t.rows.start);
    };
    return key(a) < key(b);
  });
}

void sortChannelOrder(TransfersByValue& table) {
  for (auto& [_, list] : table) sortChannelOrder(list);
}

class Planner {
 public:
  Planner(const ir::Graph& graph, const std::vector<ir::Subgraph>& pieces, const Layout& layout,
          int rank, int stage)
      : graph_(graph), pieces_(pieces), layout_(layout), rank_(rank), stage_(stage),
        rank_owns_(stage < 0 || stage == layout.place(rank).stage),
        graph_inputs_(graph.inputs().begin(), graph.inputs().end()) {
    for (size_t s = 0; s < pieces.size(); ++s) {
      for (ir::ValueId v : pieces[s].outputs) producer_[v] = static_cast<int>(s);
    }
  }

  TransferPlan plan(const DescribeTask& describe) {
    const int M = layout_.microBatches();
    TransferPlan out;
    out.rank = rank_;
    out.stage = stage_;
    out.recv.resize(M);
    out.send.resize(M);
    out.out_send.resize(M);
    for (int s = 0; s < static_cast<int>(pieces_.size()); ++s) {
      for (ir::ValueId vid : movedInputs(graph_, pieces_[s], s, describe)) {
        for (int c = 0; c < layout_.pipelines(); ++c) {
          for (int m = 0; m < M; ++m) {
            for (int j = 0; j < layout_.replicas(s); ++j) {
              for (const Transfer& t : transfersInto(s, c, m, j, vid)) {
                const bool input = graph_inputs_.count(vid) > 0;
                if (t.dst == rank_ && (stage_ < 0 || s == stage_)) out.recv[m][vid].push_back(t);
                if (t.src != rank_) continue;
                if (input) {
                  if (t.dst != rank_ && rank_owns_) out.input_sends.push_back(t);
                } else if (stage_ < 0 ? t.dst != rank_ : producer_.at(vid) == stage_) {
                  out.send[m][vid].push_back(t);  // by stage: to this rank's later stages too
                }
              }
            }
          }
        }
      }
    }
    for (auto& table : out.recv) sortChannelOrder(table);
    for (auto& table : out.send) sortChannelOrder(table);
    sortChannelOrder(out.input_sends);
    planOutputs(out);
    return out;
  }

 private:
  std::vector<Transfer> transfersInto(int stage, int copy, int m, int replica, ir::ValueId vid) const {
    const ir::Value& v = graph_.value(vid);
    const int dst = layout_.rankOf(stage, copy, replica);
    if (graph_inputs_.count(vid)) {
      if (!v.isBatch()) {  // every rank passes its own copy
        Transfer t{vid, m, dst, dst, true, {}, 0, 0};
        return {t};
      }
      auto pieces = overlaps(vid, m, layout_.share(stage, copy, m, replica), dst, /*stage=*/-1, copy);
      for (Transfer& t : pieces) t.lane = chunkOf(stage, dst);
      return pieces;
    }
    auto it = producer_.find(vid);
    RANNC_CHECK(it != producer_.end(), "no stage produces value " << vid);
    int t = it->second;
    if (!v.isBatch()) {
      int src = layout_.rankOf(t, copy, replica % layout_.replicas(t));
      return {Transfer{vid, m, src, dst, true, {}, 0, 0, lane(t, src, stage, dst)}};
    }
    auto pieces = overlaps(vid, m, layout_.share(stage, copy, m, replica), dst, t, copy);
    for (Transfer& p : pieces) p.lane = lane(t, p.src, stage, dst);
    return pieces;
  }

  // Pieces of `need` from the holders of its rows: the ranks' own rows of a model argument
  // (`producer` -1), else the replicas of the producing stage.
  std::vector<Transfer> overlaps(ir::ValueId vid, int m, const Rows& need, int dst, int producer,
                                 int copy) const {
    std::vector<Transfer> out;
    auto add = [&](int src, const Rows& held) {
      if (auto o = need.overlap(held)) out.push_back(Transfer{vid, m, src, dst, false, *o, held.start, need.start});
    };
    if (producer < 0) {
      for (int q = 0; q < layout_.worldSize(); ++q) add(q, layout_.owned(q));
    } else {
      for (int j = 0; j < layout_.replicas(producer); ++j) {
        add(layout_.rankOf(producer, copy, j), layout_.share(producer, copy, m, j));
      }
    }
    return out;
  }

  int chunks() const { return static_cast<int>(layout_.places(rank_).size()); }
  // [Note: channel lanes]: the pair of chunks a value goes between.
  int lane(int src_stage, int src, int dst_stage, int dst) const {
    return chunkOf(src_stage, src) * chunks() + chunkOf(dst_stage, dst);
  }
  // Which of `rank`'s chunks runs `stage`.
  int chunkOf(int stage, int rank) const {
    const auto& places = layout_.places(rank);
    for (size_t c = 0; c < places.size(); ++c) {
      if (places[c].stage == stage) return static_cast<int>(c);
    }
    throw InternalError("rank " + std::to_string(rank) + " does not run stage " + std::to_string(stage));
  }

  // Batch outputs go back to the ranks owning their rows.
  void planOutputs(TransferPlan& out) const {
    std::set<ir::ValueId> outputs(graph_.outputs().begin(), graph_.outputs().end());
    for (ir::ValueId vid : outputs) {
      if (graph_inputs_.count(vid) || !graph_.value(vid).isBatch()) continue;
      auto it = producer_.find(vid);
      RANNC_CHECK(it != producer_.end(), "no stage produces the output " << vid);
      int t = it->second;
      for (int c = 0; c < layout_.pipelines(); ++c) {
        for (int m = 0; m < layout_.microBatches(); ++m) {
          for (int j = 0; j < layout_.replicas(t); ++j) {
            int src = layout_.rankOf(t, c, j);
            Rows rows = layout_.share(t, c, m, j);
            for (int q = 0; q < layout_.worldSize(); ++q) {
              auto o = rows.overlap(layout_.owned(q));
              if (!o) continue;
              Transfer tr{vid, m, src, q, false, *o, rows.start, layout_.owned(q).start,
                          chunkOf(t, src) * chunks()};
              if (q == rank_ && rank_owns_) out.out_recv[vid].push_back(tr);
              if (src == rank_ && (stage_ < 0 || t == stage_)) out.out_send[m][vid].push_back(tr);
            }
          }
        }
      }
    }
    sortChannelOrder(out.out_recv);
    for (auto& table : out.out_send) sortChannelOrder(table);
  }

  const ir::Graph& graph_;
  const std::vector<ir::Subgraph>& pieces_;
  const Layout& layout_;
  int rank_;
  int stage_;       // -1: every stage of the rank
  bool rank_owns_;  // this plan carries the rank's own rows (arguments, batch outputs)
  std::set<ir::ValueId> graph_inputs_;
  std::map<ir::ValueId, int> producer_;
};

}  // namespace

bool isShapeValue(const ir::Value& v) {
  return !v.int_values.empty() && v.role == ir::ValueRole::Intermediate &&
         (v.kind != ir::ValueKind::Tensor || v.shape.empty());
}

std::vector<ir::ValueId> movedInputs(const ir::Graph& graph, const ir::Subgraph& piece, int stage,
                                     const DescribeTask& describe) {
  std::vector<ir::ValueId> moved;
  for (ir::ValueId vid : piece.inputs) {
    const ir::Value& v = graph.value(vid);
    if (v.isModelState() || v.isConstant() || isShapeValue(v)) continue;
    if (!v.isTensor()) {
      throw Error("stage " + std::to_string(stage) + " needs the " +
                  std::string(ir::valueKindName(v.kind)) + " value " +
                  (v.name.empty() ? std::to_string(vid) : v.name) +
                  " from another stage; rannc moves only tensors and shape values between stages "
                  "(produced by " + (describe ? describe(v.producer) : graph.task(v.producer).op) +
                  ")");
    }
    moved.push_back(vid);
  }
  return moved;
}

std::vector<ChannelKey> TransferPlan::deviceChannels(const ir::Graph& graph) const {
  std::set<ir::ValueId> graph_inputs(graph.inputs().begin(), graph.inputs().end());
  std::set<ChannelKey> keys;
  for (const auto* tables : {&recv, &send}) {
    for (const auto& table : *tables) {
      for (const auto& [vid, list] : table) {
        if (graph_inputs.count(vid)) continue;
        for (const Transfer& t : list) {
          keys.insert({t.src, t.dst, Channel::Activation, t.lane});
          keys.insert({t.dst, t.src, Channel::Gradient, t.lane});
        }
      }
    }
  }
  auto outputs = [&](const TransfersByValue& table) {
    for (const auto& [_, list] : table) {
      for (const Transfer& t : list) {
        keys.insert({t.src, t.dst, Channel::BatchOutput, t.lane});
        keys.insert({t.dst, t.src, Channel::OutputGradient, t.lane});
      }
    }
  };
  outputs(out_recv);
  for (const auto& table : out_send) outputs(table);
  std::vector<ChannelKey> result;
  for (const auto& k : keys) {
    if (k.src != k.dst) result.push_back(k);
  }
  return result;
}

TransferPlan planTransfers(const ir::Graph& graph, const std::vector<ir::Subgraph>& pieces,
                           const Layout& layout, int rank, const DescribeTask& describe, int stage) {
  return Planner(graph, pieces, layout, rank, stage).plan(describe);
}

std::vector<std::pair<std::vector<int>, std::vector<ir::ValueId>>> gradientGroups(
    const std::vector<ir::Subgraph>& pieces, const Layout& layout,
    const std::vector<ir::ValueId>& state_ids) {
  std::set<ir::ValueId> state(state_ids.begin(), state_ids.end());
  std::map<ir::ValueId, std::set<int>> users;
  for (size_t s = 0; s < pieces.size(); ++s) {
    for (ir::ValueId v : pieces[s].inputs) {
      if (!state.count(v)) continue;
      const auto& ranks = layout.stageRanks(static_cast<int>(s));
      users[v].insert(ranks.begin(), ranks.end());
    }
  }
  std::map<std::vector<int>, std::vector<ir::ValueId>> groups;
  for (const auto& [v, ranks] : users) groups[{ranks.begin(), ranks.end()}].push_back(v);
  return {groups.begin(), groups.end()};
}

}  // namespace rannc::runtime
