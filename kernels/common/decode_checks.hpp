// Argument checks of attention_decode_forward, shared by the CPU (kernels/cpu/decode.cpp) and CUDA
// (kernels/cuda/attention.cu) backends: shapes and dtypes only, nothing that reads tensor data or
// depends on the device (the CPU op also checks the lengths' values).
#pragma once
#include <string>

#include "moe/error.hpp"
#include "moe/ops/common.hpp"

namespace moe {

// out: [B, nh, hd], q: [B, nh, hd], k_cache, v_cache: [B, S_max, nkv, hd], nkv dividing nh.
inline void check_decode_shapes(const Tensor& out, const Tensor& q, const Tensor& k_cache,
                                const Tensor& v_cache) {
  const std::string op = "attention_decode_forward";
  MOE_CHECK(q.ndim == 3, op + ": q must be [B, nh, hd], got " + q.shape_str());
  MOE_CHECK(k_cache.ndim == 4,
            op + ": k_cache must be [B, S_max, nkv, hd], got " + k_cache.shape_str());
  const struct {
    int64_t batch, max_len, heads, kv_heads, hd;
  } s{q.size(0), k_cache.size(1), q.size(1), k_cache.size(2), q.size(2)};
  check_shape(k_cache, {s.batch, s.max_len, s.kv_heads, s.hd}, (op + ": k_cache").c_str());
  check_shape(v_cache, {s.batch, s.max_len, s.kv_heads, s.hd}, (op + ": v_cache").c_str());
  check_shape(out, {s.batch, s.heads, s.hd}, (op + ": out").c_str());
  MOE_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0,
            op + ": num_key_value_heads " + std::to_string(s.kv_heads) +
                " must divide num_attention_heads " + std::to_string(s.heads));
}

// out, k_cache, v_cache: of q's dtype; lengths: [B] i32.
inline void check_decode_dtypes(const Tensor& out, const Tensor& q, const Tensor& k_cache,
                                const Tensor& v_cache, const Tensor& lengths) {
  const std::string op = "attention_decode_forward";
  const int64_t batch = q.size(0);
  check_same_dtype(k_cache, q, (op + ": k_cache, q").c_str());
  check_same_dtype(v_cache, q, (op + ": v_cache, q").c_str());
  check_same_dtype(out, q, (op + ": out, q").c_str());
  MOE_CHECK(lengths.dtype == DType::i32,
            op + ": lengths must be i32, got " + dtype_name(lengths.dtype));
  check_shape(lengths, {batch}, (op + ": lengths").c_str());
}

}  // namespace moe
