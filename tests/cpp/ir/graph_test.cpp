#include <gtest/gtest.h>

#include "common/error.h"
#include "ir/graph.h"
#include "test_graphs.h"

namespace rannc::ir {
namespace {

using testing::chain;
using testing::diamond;
using testing::tensor;

TEST(AGraph, OrdersAChainAlongItsEdges) {
  Graph g = chain(5);
  EXPECT_EQ(g.topologicalOrder(), (std::vector<TaskId>{0, 1, 2, 3, 4}));
}

TEST(AGraph, OrdersTasksAddedOutOfOrderByTheirEdges) {
  // Tasks may be added before their producers only through a cycle-free edge list;
  // build b = f(a) first with `a` produced later.
  Graph g;
  ValueId x = tensor(g, "x", ValueRole::Input), a = tensor(g, "a"), b = tensor(g, "b");
  g.setInputs({x});
  g.addTask("aten::sin", {a}, {b});   // task 0 reads a
  g.addTask("aten::cos", {x}, {a});   // task 1 produces a
  g.setOutputs({b});
  EXPECT_EQ(g.topologicalOrder(), (std::vector<TaskId>{1, 0}));
  g.validate();
}

TEST(AGraph, PlacesEveryTaskAfterAllOfItsProducers) {
  Graph g = diamond();
  auto order = g.topologicalOrder();
  std::vector<int> pos(g.numTasks());
  for (size_t i = 0; i < order.size(); ++i) pos[order[i]] = static_cast<int>(i);
  for (const Task& t : g.tasks()) {
    for (ValueId v : t.inputs) {
      if (g.value(v).producer != kNoId) EXPECT_LT(pos[g.value(v).producer], pos[t.id]);
    }
  }
}

TEST(AGraph, CountsAValueReadTwiceByOneTaskOnce) {
  Graph g;
  ValueId x = tensor(g, "x", ValueRole::Input), a = tensor(g, "a"), b = tensor(g, "b");
  g.addTask("aten::relu", {x}, {a});
  g.addTask("aten::mul", {a, a}, {b});
  EXPECT_EQ(g.value(a).consumers.size(), 1u);
  EXPECT_EQ(g.topologicalOrder(), (std::vector<TaskId>{0, 1}));
}

TEST(AGraph, RejectsACycle) {
  Graph g;
  ValueId a = tensor(g, "a"), b = tensor(g, "b");
  g.addTask("aten::sin", {a}, {b});
  g.addTask("aten::cos", {b}, {a});
  EXPECT_THROW(g.topologicalOrder(), InvalidGraphError);
  EXPECT_THROW(g.validate(), InvalidGraphError);
}

TEST(AGraph, RejectsASecondProducerOfAValue) {
  Graph g;
  ValueId x = tensor(g, "x", ValueRole::Input), a = tensor(g, "a");
  g.addTask("aten::sin", {x}, {a});
  EXPECT_THROW(g.addTask("aten::cos", {x}, {a}), InvalidGraphError);
}

TEST(AGraph, RejectsUnknownValueIds) {
  Graph g;
  ValueId x = tensor(g, "x", ValueRole::Input);
  EXPECT_THROW(g.addTask("aten::sin", {x}, {42}), InvalidGraphError);
  EXPECT_THROW(g.setOutputs({7}), InvalidGraphError);
}

TEST(AGraph, HashesIdenticalGraphsAlike) {
  EXPECT_EQ(chain(4).contentHash(), chain(4).contentHash());
  EXPECT_EQ(diamond().contentHash(), diamond().contentHash());
}

TEST(AGraph, HashIsAFixedNumberAcrossBuildsAndProcesses) {
  // The hash keys files on disk (profile caches, saved plans), so it must not depend on
  // pointers, std::hash or the process: pin it.
  Graph g = diamond();
  const uint64_t h = g.contentHash();
  Graph copy = g;
  EXPECT_EQ(copy.contentHash(), h);
  EXPECT_EQ(h, 0x7529256c3d584ae8ULL) << std::hex << h;
}

TEST(AGraph, HashChangesWithAnOpAShapeOrAName) {
  const uint64_t base = chain(3).contentHash();
  // The same chain with one op changed.
  Graph g;
  ValueId x = tensor(g, "x", ValueRole::Input);
  g.setInputs({x});
  ValueId cur = x;
  for (int i = 0; i < 3; ++i) {
    ValueId w = tensor(g, "w" + std::to_string(i), ValueRole::Param, {8, 8});
    ValueId out = tensor(g, "h" + std::to_string(i));
    g.addTask(i == 1 ? "aten::matmul" : "aten::linear", {cur, w}, {out});
    cur = out;
  }
  g.setOutputs({cur});
  EXPECT_NE(g.contentHash(), base);

  Graph shape = chain(3);
  shape.mutableValue(2).shape = {4, 9};
  EXPECT_NE(shape.contentHash(), base);

  Graph named = chain(3);
  named.mutableValue(1).name = "renamed";
  EXPECT_NE(named.contentHash(), base);
  EXPECT_EQ(named.contentHash(/*include_names=*/false), chain(3).contentHash(false));
}

TEST(AGraph, HashIgnoresScopesAndSourceLocations) {
  Graph a = diamond(), b;
  ValueId x = tensor(b, "x", ValueRole::Input);
  ValueId p = tensor(b, "a"), q = tensor(b, "b"), r = tensor(b, "c"), s = tensor(b, "d");
  b.setInputs({x});
  b.addTask("aten::relu", {x}, {p}, "m0", "f.py:1");
  b.addTask("aten::sin", {p}, {q}, "m1", "f.py:2");
  b.addTask("aten::cos", {p}, {r}, "m2", "f.py:3");
  b.addTask("aten::add", {q, r}, {s}, "m3", "f.py:4");
  b.setOutputs({s});
  EXPECT_EQ(a.contentHash(), b.contentHash());
}

TEST(AGraph, SummarisesTasksParametersAndBatchValues) {
  Graph g = chain(2);
  g.mutableValue(0).batch_dim = 0;
  std::string s = g.summary();
  EXPECT_NE(s.find("2 tasks"), std::string::npos) << s;
  EXPECT_NE(s.find("parameters: 2 (512 bytes)"), std::string::npos) << s;
  EXPECT_NE(s.find("1 with batch dimension"), std::string::npos) << s;
}

}  // namespace
}  // namespace rannc::ir
