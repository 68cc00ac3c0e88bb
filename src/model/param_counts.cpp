// Parameter and FLOP counts per token, from the config alone (for `info` and the run header).
// Training FLOPs = 3 x forward (backward costs two forwards): forward = 2 x (matmul parameters a
// token touches) + attention scores and values (2 x 2 x heads x head_dim x mean causal context).
#include "moe/model.hpp"

namespace moe {

ParamCounts count_params(const ModelConfig& m, int seq_len) {
  const double d = m.hidden_size, hd = m.resolved_head_dim();
  const double nh = m.num_attention_heads, nkv = m.num_key_value_heads;
  const double attn = d * hd * (2 * nh + 2 * nkv);
  const double expert = 3 * d * m.intermediate_size;
  const double dense = 3 * d * m.resolved_dense_ffn();
  const double shared = m.num_shared_experts * 3 * d * m.resolved_shared_ffn();
  const double mod_extra = d + m.mod.predictor_hidden_size * (d + 1);

  ParamCounts c;
  const ParamTable table = build_param_table(m);
  c.total = static_cast<double>(table.total);
  double active_matmul = d * m.vocab_size;  // LM head (tied or not, a token pays for it)
  double attn_flops = 0;
  for (int l = 0; l < m.num_hidden_layers; ++l) {
    const bool moe = m.is_moe_layer(l);
    double block = attn + 2 * d;  // projections and norms
    block += moe ? m.num_local_experts * d + m.num_experts_per_tok * expert + shared : dense;
    double frac = 1.0, context = (seq_len + 1.0) / 2.0;  // (seq_len + 1 overflows at 2^31 - 1)
    if (m.is_mod_layer(l)) {
      frac = m.mod.capacity;  // expected share of tokens the block sees
      context = (m.mod.capacity * seq_len + 1) / 2.0;
      active_matmul += mod_extra;
    }
    active_matmul += frac * block;
    attn_flops += frac * 2 * 2 * nh * hd * context;
  }
  // Like Mixtral's "active parameters": the embedding table counts whole (tied: it is the head).
  c.active_per_token =
      active_matmul + d /* final norm */ + (m.tie_word_embeddings ? 0 : d * m.vocab_size);
  c.flops_per_token = 3 * (2 * active_matmul + attn_flops);
  return c;
}

}  // namespace moe
