#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "common/error.h"
#include "ir/subgraph.h"
#include "test_graphs.h"

namespace rannc::ir {
namespace {

using testing::chain;
using testing::diamond;
using testing::skip;
using testing::tensor;

// Brute-force convexity: for every pair (u in S, w in S) is there a path u -> v -> w
// with v outside S?
bool bruteConvex(const Graph& g, const std::vector<TaskId>& set) {
  const int n = g.numTasks();
  std::vector<std::vector<char>> reach(n, std::vector<char>(n, 0));
  for (const Task& t : g.tasks()) {
    for (ValueId v : t.outputs) {
      for (TaskId c : g.value(v).consumers) reach[t.id][c] = 1;
    }
  }
  for (int k = 0; k < n; ++k)
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j)
        if (reach[i][k] && reach[k][j]) reach[i][j] = 1;
  std::vector<char> in(n, 0);
  for (TaskId t : set) in[t] = 1;
  for (int u = 0; u < n; ++u)
    for (int v = 0; v < n; ++v)
      for (int w = 0; w < n; ++w)
        if (in[u] && !in[v] && in[w] && reach[u][v] && reach[v][w]) return false;
  return true;
}

TEST(ASubgraph, KnowsTheSidesOfADiamondAreNotConvexWithoutTheTop) {
  Graph g = diamond();
  EXPECT_TRUE(isConvex(g, {0, 1, 2, 3}));
  EXPECT_TRUE(isConvex(g, {1, 2}));
  EXPECT_TRUE(isConvex(g, {0, 1}));
  EXPECT_FALSE(isConvex(g, {0, 3}));  // 0 -> 1 -> 3 leaves and re-enters
  EXPECT_FALSE(isConvex(g, {0, 1, 3}));
}

TEST(ASubgraph, RejectsCuttingAResidualSkipInTheMiddle) {
  Graph g = skip();
  EXPECT_TRUE(isConvex(g, {0, 1}));
  EXPECT_TRUE(isConvex(g, {1, 2, 3}));
  EXPECT_FALSE(isConvex(g, {0, 3}));
  EXPECT_THROW(extractSubgraph(g, {0, 3}), InvalidGraphError);
}

TEST(ASubgraph, NamesTheOffendingTaskWhenNotConvex) {
  Graph g = diamond();
  try {
    extractSubgraph(g, {0, 3});
    FAIL() << "expected InvalidGraphError";
  } catch (const InvalidGraphError& e) {
    EXPECT_NE(std::string(e.what()).find("not convex"), std::string::npos) << e.what();
  }
}

TEST(ASubgraph, ListsBoundaryInputsAndOutputs) {
  Graph g = skip();
  Subgraph p = extractSubgraph(g, {1, 2});
  EXPECT_EQ(p.tasks, (std::vector<TaskId>{1, 2}));
  EXPECT_EQ(p.inputs, (std::vector<ValueId>{1}));   // a
  EXPECT_EQ(p.outputs, (std::vector<ValueId>{3}));  // c
  Subgraph head = extractSubgraph(g, {0});
  EXPECT_EQ(head.inputs, (std::vector<ValueId>{0}));
  EXPECT_EQ(head.outputs, (std::vector<ValueId>{1}));  // a feeds both 1 and 3
  Subgraph tail = extractSubgraph(g, {3});
  EXPECT_EQ(tail.outputs, (std::vector<ValueId>{4}));  // graph output
}

TEST(ASubgraph, ListsParametersAsInputs) {
  Graph g = chain(3);
  Subgraph p = extractSubgraph(g, {1});
  ASSERT_EQ(p.inputs.size(), 2u);
  EXPECT_EQ(g.value(p.inputs[1]).role, ValueRole::Param);
}

TEST(ASubgraph, RejectsEmptyAndDuplicateSets) {
  Graph g = chain(3);
  EXPECT_THROW(extractSubgraph(g, {}), InvalidGraphError);
  EXPECT_THROW(extractSubgraph(g, {1, 1}), InvalidGraphError);
  EXPECT_THROW(extractSubgraph(g, {9}), InvalidGraphError);
}

TEST(ASubgraph, HashesIdenticalLayersAlikeWhereverTheySit) {
  Graph g = chain(4);
  EXPECT_EQ(contentHash(g, extractSubgraph(g, {1})), contentHash(g, extractSubgraph(g, {2})));
  EXPECT_EQ(contentHash(g, extractSubgraph(g, {0, 1})),
            contentHash(g, extractSubgraph(g, {2, 3})));
  EXPECT_NE(contentHash(g, extractSubgraph(g, {1})), contentHash(g, extractSubgraph(g, {1, 2})));
}

TEST(ASplit, CutsIntoKContiguousConvexPiecesCoveringEveryTaskOnce) {
  Graph g = chain(10);
  for (int k = 1; k <= 10; ++k) {
    auto pieces = splitTopological(g, k);
    ASSERT_EQ(pieces.size(), static_cast<size_t>(k));
    std::vector<TaskId> all;
    for (auto& p : pieces) {
      EXPECT_FALSE(p.tasks.empty());
      EXPECT_TRUE(isConvex(g, p.tasks));
      all.insert(all.end(), p.tasks.begin(), p.tasks.end());
    }
    EXPECT_EQ(all, g.topologicalOrder());
  }
  EXPECT_THROW(splitTopological(g, 0), InvalidGraphError);
  EXPECT_THROW(splitTopological(g, 11), InvalidGraphError);
}

TEST(ASplit, MovesACutSoThatNoGradientCarryingListCrossesIt) {
  // x -> a -> [list] -> b -> c: a cut between the list and its reader moves after it.
  Graph g;
  ValueId x = tensor(g, "x", ValueRole::Input), a = tensor(g, "a"), b = tensor(g, "b"),
          c = tensor(g, "c");
  Value list;
  list.name = "list";
  list.kind = ValueKind::TensorList;
  list.requires_grad = true;
  ValueId l = g.addValue(list);
  g.setInputs({x});
  g.addTask("aten::relu", {x}, {a});
  g.addTask("prim::ListConstruct", {a}, {l});
  g.addTask("aten::cat", {l}, {b});
  g.addTask("aten::sin", {b}, {c});
  g.setOutputs({c});
  auto pieces = splitTopological(g, 2);  // nominal cut after 2 tasks: the list would cross
  EXPECT_EQ(pieces[0].tasks, (std::vector<TaskId>{0, 1, 2}));
  EXPECT_EQ(pieces[1].tasks, (std::vector<TaskId>{3}));
}

TEST(ARandomDag, AgreesWithBruteForceOnConvexity) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 200; ++trial) {
    Graph g;
    const int n = 3 + static_cast<int>(rng() % 6);
    std::vector<ValueId> outs;
    ValueId x = tensor(g, "x", ValueRole::Input);
    for (int i = 0; i < n; ++i) {
      std::vector<ValueId> ins{x};
      for (ValueId o : outs) {
        if (rng() % 3 == 0) ins.push_back(o);
      }
      ValueId out = tensor(g, "v" + std::to_string(i));
      g.addTask("aten::op", ins, {out});
      outs.push_back(out);
    }
    for (uint32_t mask = 1; mask < (1u << n); ++mask) {
      std::vector<TaskId> set;
      for (int i = 0; i < n; ++i)
        if (mask & (1u << i)) set.push_back(i);
      ASSERT_EQ(isConvex(g, set), bruteConvex(g, set)) << "trial " << trial << " mask " << mask;
    }
  }
}

}  // namespace
}  // namespace rannc::ir
