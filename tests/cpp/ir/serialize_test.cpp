#include <gtest/gtest.h>

#include <cstdio>

#include "common/error.h"
#include "ir/serialize.h"
#include "test_graphs.h"

namespace rannc::ir {
namespace {

Graph richGraph() {
  Graph g = testing::chain(3);
  g.setBatchSize(4);
  Value c;
  c.name = "alpha";
  c.kind = ValueKind::Float;
  c.role = ValueRole::Constant;
  c.constant = "0.5";
  ValueId alpha = g.addValue(c);
  Value out;
  out.name = "loss";
  out.dtype = DType::Float32;
  out.is_loss = true;
  out.batch_dependent = true;
  ValueId loss = g.addValue(out);
  g.mutableValue(0).batch_dim = 0;
  g.mutableValue(0).batch_multiple = 1;
  g.addTask("aten::mul", {g.outputs()[0], alpha}, {loss}, "head", "model.py:12");
  g.setOutputs({loss});
  return g;
}

std::string expectSerializationError(const std::string& bytes) {
  try {
    deserializeGraph(bytes, "test.rannc");
  } catch (const SerializationError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected SerializationError";
  return {};
}

TEST(ASerializedGraph, RoundTripsEveryField) {
  Graph g = richGraph();
  Graph back = deserializeGraph(serializeGraph(g));
  EXPECT_EQ(back.contentHash(), g.contentHash());
  ASSERT_EQ(back.numValues(), g.numValues());
  ASSERT_EQ(back.numTasks(), g.numTasks());
  EXPECT_EQ(back.batchSize(), 4);
  for (int i = 0; i < g.numValues(); ++i) {
    const Value &a = g.value(i), &b = back.value(i);
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.kind, b.kind);
    EXPECT_EQ(a.role, b.role);
    EXPECT_EQ(a.shape, b.shape);
    EXPECT_EQ(a.batch_dim, b.batch_dim);
    EXPECT_EQ(a.is_loss, b.is_loss);
    EXPECT_EQ(a.constant, b.constant);
    EXPECT_EQ(a.consumers, b.consumers);
  }
  EXPECT_EQ(back.task(3).scope, "head");
  EXPECT_EQ(back.task(3).source, "model.py:12");
  EXPECT_EQ(back.inputs(), g.inputs());
  EXPECT_EQ(back.outputs(), g.outputs());
}

TEST(ASerializedGraph, RoundTripsThroughAFile) {
  Graph g = richGraph();
  const std::string path = ::testing::TempDir() + "/graph.rannc";
  saveGraph(g, path);
  EXPECT_EQ(loadGraph(path).contentHash(), g.contentHash());
  std::remove(path.c_str());
}

TEST(ASerializedGraph, RejectsAFlippedByteAsCorrupt) {
  std::string bytes = serializeGraph(richGraph());
  bytes[bytes.size() / 2] ^= 0x5a;
  EXPECT_NE(expectSerializationError(bytes).find("corrupt"), std::string::npos);
}

TEST(ASerializedGraph, RejectsATruncatedFile) {
  std::string bytes = serializeGraph(richGraph());
  std::string msg = expectSerializationError(bytes.substr(0, bytes.size() - 20));
  EXPECT_NE(msg.find("test.rannc"), std::string::npos) << msg;
}

TEST(ASerializedGraph, RejectsAnotherFileType) {
  EXPECT_NE(expectSerializationError("hello world, not a graph").find("bad magic"),
            std::string::npos);
}

TEST(ASerializedGraph, RejectsAnotherVersionSayingWhichItFound) {
  std::string bytes = frame("graph", kGraphFormatVersion + 1, "payload");
  std::string msg = expectSerializationError(bytes);
  EXPECT_NE(msg.find("version " + std::to_string(kGraphFormatVersion + 1)), std::string::npos)
      << msg;
}

TEST(ASerializedGraph, RejectsAnotherKindOfRanncFile) {
  std::string bytes = frame("deployment", kGraphFormatVersion, "payload");
  EXPECT_NE(expectSerializationError(bytes).find("expected a 'graph'"), std::string::npos);
}

TEST(ASerializedGraph, ReportsAMissingFile) {
  EXPECT_THROW(loadGraph("/nonexistent/dir/graph.rannc"), SerializationError);
}

}  // namespace
}  // namespace rannc::ir
