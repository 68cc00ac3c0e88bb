// The parameter layout: every parameter's Hugging Face name, kind, shape and offset in the one
// contiguous buffer. The order follows the checkpoint names layer by layer, so a layer's
// parameters are adjacent (ZeRO-3 can gather a layer as one range later).
#include <cmath>
#include <stdexcept>

#include "moe/model.hpp"

namespace moe {

bool param_kind_decays(ParamKind k) {
  return k != ParamKind::norm;
}

size_t ParamInfo::numel() const {
  size_t n = static_cast<size_t>(stack);
  for (int64_t s : shape) n *= static_cast<size_t>(s);
  return n;
}

Tensor ParamInfo::view(void* data, DType dt, Device dev) const {
  Tensor t(data, dt, dev, {});
  t.ndim = static_cast<int>(shape.size()) + (stack > 1 ? 1 : 0);
  int i = 0;
  if (stack > 1) t.shape[i++] = stack;
  for (int64_t s : shape) t.shape[i++] = s;
  return t;
}

const ParamInfo& ParamTable::find(const std::string& name) const {
  for (const auto& p : params)
    if (p.name == name) return p;
  throw InternalError("no parameter named " + name);
}

namespace {

struct TableBuilder {
  ParamTable t;
  void add(std::string name, ParamKind kind, std::vector<int64_t> shape, int stack = 1,
           bool fp32_reads = false) {
    ParamInfo p{std::move(name), kind, stack, std::move(shape), t.total, fp32_reads};
    t.total += p.numel();
    t.params.push_back(std::move(p));
  }
  void swiglu(const std::string& prefix, const char* w1, const char* w3, const char* w2, int64_t d,
              int64_t f, int stack = 1) {
    add(prefix + w1 + ".weight", ParamKind::matrix, {f, d}, stack);
    add(prefix + w3 + ".weight", ParamKind::matrix, {f, d}, stack);
    add(prefix + w2 + ".weight", ParamKind::residual, {d, f}, stack);
  }
};

}  // namespace

ParamTable build_param_table(const ModelConfig& m) {
  TableBuilder b;
  const int64_t d = m.hidden_size, hd = m.resolved_head_dim();
  b.add("model.embed_tokens.weight", ParamKind::embedding, {m.vocab_size, d});
  for (int l = 0; l < m.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    b.add(p + "input_layernorm.weight", ParamKind::norm, {d});
    b.add(p + "self_attn.q_proj.weight", ParamKind::matrix, {m.num_attention_heads * hd, d});
    b.add(p + "self_attn.k_proj.weight", ParamKind::matrix, {m.num_key_value_heads * hd, d});
    b.add(p + "self_attn.v_proj.weight", ParamKind::matrix, {m.num_key_value_heads * hd, d});
    b.add(p + "self_attn.o_proj.weight", ParamKind::residual, {d, m.num_attention_heads * hd});
    b.add(p + "post_attention_layernorm.weight", ParamKind::norm, {d});
    if (m.is_mod_layer(l)) {
      // The MoD router and the predictor's head run in fp32 on the master weights; the
      // predictor's first layer is a compute-dtype product with fp32 sums (mod_block.cpp).
      b.add(p + "mod.router.weight", ParamKind::matrix, {1, d}, 1, true);
      b.add(p + "mod.predictor.fc1.weight", ParamKind::matrix, {m.mod.predictor_hidden_size, d});
      b.add(p + "mod.predictor.fc2.weight", ParamKind::matrix, {1, m.mod.predictor_hidden_size}, 1,
            true);
    }
    if (m.is_moe_layer(l)) {
      const std::string moe = p + "block_sparse_moe.";
      b.add(moe + "gate.weight", ParamKind::matrix, {m.num_local_experts, d}, 1,
            true);  // the router's logits are fp32 (moe_ffn.cpp)
      b.swiglu(moe + "experts.{j}.", "w1", "w3", "w2", d, m.intermediate_size, m.num_local_experts);
      for (int s = 0; s < m.num_shared_experts; ++s)
        b.swiglu(moe + "shared_experts." + std::to_string(s) + ".", "w1", "w3", "w2", d,
                 m.resolved_shared_ffn());
    } else {
      b.swiglu(p + "mlp.", "gate_proj", "up_proj", "down_proj", d, m.resolved_dense_ffn());
    }
  }
  b.add("model.norm.weight", ParamKind::norm, {d});
  if (!m.tie_word_embeddings) b.add("lm_head.weight", ParamKind::matrix, {m.vocab_size, d});
  return b.t;
}

std::vector<size_t> param_unit_bounds(const ParamTable& t, const ModelConfig& m) {
  std::vector<size_t> bounds{0};
  for (int l = 0; l < m.num_hidden_layers; ++l)
    bounds.push_back(
        t.find("model.layers." + std::to_string(l) + ".input_layernorm.weight").offset);
  bounds.push_back(t.find("model.norm.weight").offset);
  bounds.push_back(t.total);
  return bounds;
}

}  // namespace moe
