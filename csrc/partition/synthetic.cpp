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
  ir::ValueId buffer(const std::string& name, std::vector<int64_t> shape,
                     ir::DType dtype = ir::DType::Float32) {
    ir::Value v;
    v.name = name;
    v.role = ir::ValueRole::Buffer;
    v.dtype = dtype;
    v.shape = std::move(shape);
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
  // The mean loss over the batch: the value the backward starts from, the graph's output.
  void loss(std::vector<ir::ValueId> in, const std::string& scope) {
    ir::Value loss;
    loss.name = "loss";
    loss.dtype = ir::DType::Float32;
    loss.batch_dependent = true;
    loss.is_loss = true;
    loss.requires_grad = true;
    ir::ValueId l = g_.addValue(loss);
    op("aten::cross_entropy", std::move(in), l, scope);
    g_.setOutputs({l});
  }
  void inputs(const std::vector<ir::ValueId>& in) {
    for (ir::ValueId v : in) g_.mutableValue(v).role = ir::ValueRole::Input;
    g_.setInputs(in);
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
  b.loss({logits, ids}, "head");
  return std::move(b.graph());
}

ir::Graph syntheticGpt(const SyntheticGptOptions& o) {
  Builder b(o.batch_size);
  const int64_t H = o.hidden, L = o.seq_len, nh = o.heads, dh = o.hidden / o.heads;
  ir::ValueId ids = b.act("input_ids", {L}, ir::DType::Int64);
  ir::ValueId labels = b.act("labels", {L}, ir::DType::Int64);
  b.inputs({ids, labels});
  // Position ids are baked into the trace (arange): a constant task cloned into its reader.
  ir::Value pos;
  pos.name = "position_ids";
  pos.dtype = ir::DType::Int64;
  pos.shape = {1, L};
  ir::ValueId pos_ids = b.op("aten::arange", {b.constant(std::to_string(L))}, b.graph().addValue(pos), "transformer");
  ir::ValueId wte = b.param("transformer.wte.weight", {o.vocab, H});
  ir::ValueId wpe = b.param("transformer.wpe.weight", {L, H});
  ir::ValueId tok = b.op("aten::embedding", {wte, ids}, b.act("tok_emb", {L, H}), "transformer");
  ir::Value pe;
  pe.name = "pos_emb";
  pe.dtype = ir::DType::Float32;
  pe.shape = {1, L, H};
  pe.requires_grad = true;
  ir::ValueId pemb = b.op("aten::embedding", {wpe, pos_ids}, b.graph().addValue(pe), "transformer");
  ir::ValueId h = b.op("aten::add", {tok, pemb}, b.act("emb", {L, H}), "transformer");
  h = b.op("aten::dropout", {h, b.constant("0.1")}, b.act("emb_d", {L, H}), "transformer");

  auto linear = [&](ir::ValueId x, int64_t in, int64_t out, const std::string& name,
                    std::vector<int64_t> out_rest, const std::string& scope) {
    ir::ValueId w = b.param(scope + "." + name + ".weight", {out, in});
    ir::ValueId bias = b.param(scope + "." + name + ".bias", {out});
    return b.op("aten::linear", {x, w, bias}, b.act(scope + "." + name, std::move(out_rest)), scope);
  };
  auto layerNorm = [&](ir::ValueId x, const std::string& name) {
    ir::ValueId w = b.param(name + ".weight", {H});
    ir::ValueId bias = b.param(name + ".bias", {H});
    return b.op("aten::layer_norm", {x, w, bias}, b.act(name, {L, H}), name);
  };
  for (int i = 0; i < o.layers; ++i) {
    const std::string s = "transformer.h." + std::to_string(i);
    ir::ValueId x = layerNorm(h, s + ".ln_1");
    ir::ValueId qkv = linear(x, H, 3 * H, "attn.c_attn", {L, 3 * H}, s);
    auto heads = [&](const std::string& name, int part) {
      ir::ValueId p = b.op("aten::slice", {qkv, b.constant("2," + std::to_string(part * H))},
                           b.act(s + "." + name, {L, H}), s);
      ir::ValueId v = b.op("aten::view", {p, b.constant("shape")}, b.act(s + "." + name + "_v", {L, nh, dh}), s);
      return b.op("aten::permute", {v, b.constant("0,2,1,3")}, b.act(s + "." + name + "_t", {nh, L, dh}), s);
    };
    ir::ValueId q = heads("q", 0), k = heads("k", 1), v = heads("v", 2);
    ir::ValueId kt = b.op("aten::transpose", {k, b.constant("-1,-2")}, b.act(s + ".kt", {nh, dh, L}), s);
    ir::ValueId sc = b.op("aten::matmul", {q, kt}, b.act(s + ".scores", {nh, L, L}), s);
    sc = b.op("aten::div", {sc, b.constant("8.0")}, b.act(s + ".scaled", {nh, L, L}), s);
    // The causal mask is a per-layer buffer, as in GPT-2 (attn.bias).
    ir::ValueId causal = b.buffer(s + ".attn.bias", {1, 1, L, L}, ir::DType::Bool);
    sc = b.op("aten::where", {causal, sc, b.constant("-inf")}, b.act(s + ".masked", {nh, L, L}), s);
    ir::ValueId p = b.op("aten::softmax", {sc, b.constant("-1")}, b.act(s + ".probs", {nh, L, L}), s);
    p = b.op("aten::dropout", {p, b.constant("0.1")}, b.act(s + ".probs_d", {nh, L, L}), s);
    ir::ValueId ctx = b.op("aten::matmul", {p, v}, b.act(s + ".ctx", {nh, L, dh}), s);
    ctx = b.op("aten::permute", {ctx, b.constant("0,2,1,3")}, b.act(s + ".ctx_t", {L, nh, dh}), s);
    ctx = b.op("aten::reshape", {ctx, b.constant("shape")}, b.act(s + ".ctx_r", {L, H}), s);
    ir::ValueId att = linear(ctx, H, H, "attn.c_proj", {L, H}, s);
    att = b.op("aten::dropout", {att, b.constant("0.1")}, b.act(s + ".att_d", {L, H}), s);
    h = b.op("aten::add", {att, h}, b.act(s + ".res1", {L, H}), s);
    x = layerNorm(h, s + ".ln_2");
    ir::ValueId f = linear(x, H, 4 * H, "mlp.c_fc", {L, 4 * H}, s);
    f = b.op("aten::gelu", {f}, b.act(s + ".gelu", {L, 4 * H}), s);
    f = linear(f, 4 * H, H, "mlp.c_proj", {L, H}, s);
    f = b.op("aten::dropout", {f, b.constant("0.1")}, b.act(s + ".mlp_d", {L, H}), s);
    h = b.op("aten::add", {f, h}, b.act(s + ".res2", {L, H}), s);
  }
  h = layerNorm(h, "transformer.ln_f");
  // Tied LM head: the token embedding's weight, no bias.
  ir::ValueId logits = b.op("aten::linear", {h, wte}, b.act("lm_head", {L, o.vocab}), "lm_head");
  b.loss({logits, labels}, "lm_head");
  return std::move(b.graph());
}

ir::Graph syntheticResNet(const SyntheticResNetOptions& o) {
  Builder b(o.batch_size);
  const int64_t w = o.width_factor;
  ir::ValueId image = b.act("images", {3, o.image, o.image});
  b.graph().mutableValue(image).requires_grad = false;
  ir::ValueId labels = b.act("labels", {}, ir::DType::Int64);
  b.inputs({image, labels});
  int64_t size = o.image;  // spatial side of the current activation
  auto conv = [&](ir::ValueId x, int64_t in, int64_t out, int64_t kernel, int64_t stride,
                  const std::string& name) {
    ir::ValueId wt = b.param(name + ".weight", {out, in, kernel, kernel});
    const int64_t pad = kernel / 2;
    const int64_t side = (size + 2 * pad - kernel) / stride + 1;
    return b.op("aten::conv2d",
                {x, wt, b.constant(std::to_string(stride)), b.constant(std::to_string(pad))},
                b.act(name, {out, side, side}), name);
  };
  auto bn = [&](ir::ValueId x, int64_t ch, int64_t side, const std::string& name) {
    ir::ValueId wt = b.param(name + ".weight", {ch});
    ir::ValueId bias = b.param(name + ".bias", {ch});
    ir::ValueId mean = b.buffer(name + ".running_mean", {ch});
    ir::ValueId var = b.buffer(name + ".running_var", {ch});
    return b.op("aten::batch_norm", {x, wt, bias, mean, var}, b.act(name, {ch, side, side}), name);
  };
  auto relu = [&](ir::ValueId x, int64_t ch, int64_t side, const std::string& name) {
    return b.op("aten::relu_", {x}, b.act(name + ".relu", {ch, side, side}), name);
  };
  int64_t ch = 64 * w;
  ir::ValueId x = conv(image, 3, ch, 7, 2, "conv1");
  size = (size + 6 - 7) / 2 + 1;
  x = relu(bn(x, ch, size, "bn1"), ch, size, "bn1");
  size = (size + 2 - 3) / 2 + 1;
  x = b.op("aten::max_pool2d", {x, b.constant("3,2,1")}, b.act("maxpool", {ch, size, size}), "maxpool");
  for (size_t stage = 0; stage < o.blocks.size(); ++stage) {
    const int64_t mid = (64 << stage) * w, out = 4 * mid;
    for (int i = 0; i < o.blocks[stage]; ++i) {
      const std::string s = "layer" + std::to_string(stage + 1) + "." + std::to_string(i);
      const int64_t stride = (i == 0 && stage > 0) ? 2 : 1;
      const int64_t in_size = size, out_size = (size + 2 - 3) / stride + 1;
      ir::ValueId y = conv(x, ch, mid, 1, 1, s + ".conv1");
      y = relu(bn(y, mid, in_size, s + ".bn1"), mid, in_size, s + ".bn1");
      y = conv(y, mid, mid, 3, stride, s + ".conv2");
      size = out_size;
      y = relu(bn(y, mid, size, s + ".bn2"), mid, size, s + ".bn2");
      y = bn(conv(y, mid, out, 1, 1, s + ".conv3"), out, size, s + ".bn3");
      ir::ValueId shortcut = x;
      if (i == 0) {
        // Projection shortcut: a strided 1x1 conv from the block's input side.
        size = in_size;
        ir::ValueId d = conv(x, ch, out, 1, stride, s + ".downsample.0");
        size = out_size;
        shortcut = bn(d, out, size, s + ".downsample.1");
      }
      y = b.op("aten::add_", {y, shortcut}, b.act(s + ".add", {out, size, size}), s);
      x = relu(y, out, size, s);
      ch = out;
    }
  }
  x = b.op("aten::adaptive_avg_pool2d", {x, b.constant("1,1")}, b.act("avgpool", {ch, 1, 1}), "avgpool");
  x = b.op("aten::flatten", {x, b.constant("1")}, b.act("flatten", {ch}), "avgpool");
  ir::ValueId fw = b.param("fc.weight", {o.classes, ch});
  ir::ValueId fb = b.param("fc.bias", {o.classes});
  ir::ValueId logits = b.op("aten::linear", {x, fw, fb}, b.act("fc", {o.classes}), "fc");
  b.loss({logits, labels}, "fc");
  return std::move(b.graph());
}

}  // namespace rannc::partition
