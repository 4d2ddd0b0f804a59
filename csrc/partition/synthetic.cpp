#include "partition/synthetic.h"

#include <string>

namespace rannc::partition {
namespace {

class Builder {
 public:
  explicit Builder(int64_t batch) : batch_(batch) { g_.setBatchSize(batch); }

  // A tensor whose first dimension is the batch.
  ir::ValueId act(const std::string& name, std::vector<int64_t> rest,
                  ir::DType dtype = ir::DType::Float32) {
    ir::Value v;
    v.name = name;
    v.dtype = dtype;
    v.shape = {batch_};
    v.shape.insert(v.shape.end(), rest.begin(), rest.end());
    v.batch_dim = 0;
    v.batch_multiple = 1;
    v.batch_dependent = true;
    v.requires_grad = dtype == ir::DType::Float32;
    return g_.addValue(v);
  }
  ir::ValueId param(const std::string& name, std::vector<int64_t> shape) {
    ir::Value v;
    v.name = name;
    v.role = ir::ValueRole::Param;
    v.dtype = ir::DType::Float32;
    v.shape = std::move(shape);
    v.requires_grad = true;
    return g_.addValue(v);
  }
  ir::ValueId constant(const std::string& text) {
    ir::Value v;
    v.name = "c" + std::to_string(g_.numValues());
    v.kind = ir::ValueKind::Int;
    v.role = ir::ValueRole::Constant;
    v.constant = text;
    return g_.addValue(v);
  }
  ir::ValueId op(const std::string& name, std::vector<ir::ValueId> in, ir::ValueId out,
                 const std::string& scope) {
    g_.addTask(name, std::move(in), {out}, scope);
    return out;
  }
  ir::Graph& graph() { return g_; }

 private:
  int64_t batch_;
  ir::Graph g_;
};

}  // namespace

ir::Graph syntheticTransformer(const SyntheticTransformerOptions& o) {
  Builder b(o.batch_size);
  const int64_t H = o.hidden, L = o.seq_len, nh = o.heads, dh = o.hidden / o.heads;
  ir::ValueId ids = b.act("input_ids", {L}, ir::DType::Int64);
  std::vector<ir::ValueId> inputs{ids};
  ir::ValueId mask = ir::kNoId;
  if (o.with_mask) {
    ir::ValueId raw = b.act("attention_mask", {L}, ir::DType::Float32);
    inputs.push_back(raw);
    ir::ValueId m1 = b.op("aten::unsqueeze", {raw, b.constant("1")}, b.act("mask1", {1, 1, L}), "embeddings");
    ir::ValueId m2 = b.op("aten::rsub", {m1, b.constant("1.0")}, b.act("mask2", {1, 1, L}), "embeddings");
    mask = b.op("aten::mul", {m2, b.constant("-10000.0")}, b.act("mask", {1, 1, L}), "embeddings");
  }
  for (ir::ValueId v : inputs) b.graph().mutableValue(v).role = ir::ValueRole::Input;
  b.graph().setInputs(inputs);
  ir::ValueId emb_w = b.param("embeddings.word.weight", {o.vocab, H});
  ir::ValueId h = b.op("aten::embedding", {emb_w, ids}, b.act("emb", {L, H}), "embeddings");
  ir::ValueId ln_w = b.param("embeddings.norm.weight", {H});
  h = b.op("aten::layer_norm", {h, ln_w}, b.act("emb_ln", {L, H}), "embeddings");

  auto linear = [&](ir::ValueId x, int64_t in, int64_t out, const std::string& name,
                    std::vector<int64_t> out_rest, const std::string& scope) {
    ir::ValueId w = b.param(scope + "." + name + ".weight", {out, in});
    ir::ValueId bias = b.param(scope + "." + name + ".bias", {out});
    return b.op("aten::linear", {x, w, bias}, b.act(scope + "." + name, std::move(out_rest)), scope);
  };
  for (int i = 0; i < o.layers; ++i) {
    const std::string s = "encoder.layer." + std::to_string(i);
    auto heads = [&](ir::ValueId x, const std::string& name) {
      ir::ValueId v = b.op("aten::view", {x, b.constant("shape")}, b.act(s + "." + name + "_v", {L, nh, dh}), s);
      return b.op("aten::transpose", {v, b.constant("1,2")}, b.act(s + "." + name + "_t", {nh, L, dh}), s);
    };
    ir::ValueId q = heads(linear(h, H, H, "query", {L, H}, s), "q");
    ir::ValueId k = heads(linear(h, H, H, "key", {L, H}, s), "k");
    ir::ValueId v = heads(linear(h, H, H, "value", {L, H}, s), "v");
    ir::ValueId kt = b.op("aten::transpose", {k, b.constant("-1,-2")}, b.act(s + ".kt", {nh, dh, L}), s);
    ir::ValueId sc = b.op("aten::matmul", {q, kt}, b.act(s + ".scores", {nh, L, L}), s);
    sc = b.op("aten::div", {sc, b.constant("8.0")}, b.act(s + ".scaled", {nh, L, L}), s);
    if (mask != ir::kNoId) sc = b.op("aten::add", {sc, mask}, b.act(s + ".masked", {nh, L, L}), s);
    ir::ValueId p = b.op("aten::softmax", {sc, b.constant("-1")}, b.act(s + ".probs", {nh, L, L}), s);
    p = b.op("aten::dropout", {p, b.constant("0.1")}, b.act(s + ".probs_d", {nh, L, L}), s);
    ir::ValueId ctx = b.op("aten::matmul", {p, v}, b.act(s + ".ctx", {nh, L, dh}), s);
    ctx = b.op("aten::transpose", {ctx, b.constant("1,2")}, b.act(s + ".ctx_t", {L, nh, dh}), s);
    ctx = b.op("aten::reshape", {ctx, b.constant("shape")}, b.act(s + ".ctx_r", {L, H}), s);
    ir::ValueId att = linear(ctx, H, H, "output", {L, H}, s);
    att = b.op("aten::dropout", {att, b.constant("0.1")}, b.act(s + ".att_d", {L, H}), s);
    att = b.op("aten::add", {att, h}, b.act(s + ".res1", {L, H}), s);
    ir::ValueId lnw1 = b.param(s + ".norm1.weight", {H});
    ir::ValueId h1 = b.op("aten::layer_norm", {att, lnw1}, b.act(s + ".ln1", {L, H}), s);
    ir::ValueId f = linear(h1, H, 4 * H, "ffn1", {L, 4 * H}, s);
    f = b.op("aten::gelu", {f}, b.act(s + ".gelu", {L, 4 * H}), s);
    f = linear(f, 4 * H, H, "ffn2", {L, H}, s);
    f = b.op("aten::dropout", {f, b.constant("0.1")}, b.act(s + ".ffn_d", {L, H}), s);
    f = b.op("aten::add", {f, h1}, b.act(s + ".res2", {L, H}), s);
    ir::ValueId lnw2 = b.param(s + ".norm2.weight", {H});
    h = b.op("aten::layer_norm", {f, lnw2}, b.act(s + ".ln2", {L, H}), s);
  }
  ir::ValueId logits = linear(h, H, o.vocab, "head", {L, o.vocab}, "head");
  ir::Value loss;
  loss.name = "loss";
  loss.dtype = ir::DType::Float32;
  loss.batch_dependent = true;
  loss.is_loss = true;
  loss.requires_grad = true;
  ir::ValueId l = b.graph().addValue(loss);
  b.op("aten::cross_entropy", {logits, ids}, l, "head");
  b.graph().setOutputs({l});
  return std::move(b.graph());
}

}  // namespace rannc::partition
