// CUDA attention against the CPU reference: causal GQA forward (out, lse) and backward (dq, dk, dv)
// for B = 2, T = 37 (a multiple of nothing the kernels tile by), nh = 4, nkv = 2 (two query heads
// per kv head), hd = 32 and 64, in f32, f64, f16 and bf16; and decode attention over a cache whose
// unused entries hold NaN (so reading past lengths[b] would show). The tensor-core kernels get
// their tile edges, longer sequences, MHA and both the sm_90 and sm_80 paths in a case of their
// own.
//
// Inputs are random (never zero), rounded to the storage dtype, and the CPU op runs in f64 on the
// same rounded values; the backward's out and lse inputs are the CPU forward's, rounded to the
// dtype (lse to acc_dtype: f32 for 16-bit q, as the op requires), so both sides differentiate
// exactly the same data. Outputs are poisoned (NaN) first.
// Tolerance per element: |gpu - ref| <= rtol (|ref| + max|ref|), rtol = rtol_for(dtype):
// f32 2e-5 (fp32 accumulation over <= 64-long dot products and <= 37-long sums), f64 1e-11,
// f16 4e-3 and bf16 2e-2 (fp32 math, one rounding of each output into the dtype); the fp32 lse of
// 16-bit inputs gets the f32 bound.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/ops/attention.hpp"
#include "moe/ops/decode.hpp"

using namespace moe;
using namespace moe::test;

namespace {

const char* name_of(DType dt) {
  return dtype_name(dt);
}

void check_attention(DType dt, int64_t hd, int64_t T = 37, int64_t nh = 4, int64_t nkv = 2,
                     int64_t B = 2) {
  INFO("dtype " << name_of(dt) << ", hd " << hd << ", T " << T << ", B " << B << ", nh " << nh
                << ", nkv " << nkv);
  const double rtol = rtol_for(dt);
  const DType acc = acc_dtype(dt);
  const size_t nq = static_cast<size_t>(B * T * nh * hd),
               nkv_el = static_cast<size_t>(B * T * nkv * hd);
  const std::vector<double> q = round_to(dt, random_values(nq, 11, -2.0, 2.0));
  const std::vector<double> k = round_to(dt, random_values(nkv_el, 12));
  const std::vector<double> v = round_to(dt, random_values(nkv_el, 13));
  const std::vector<double> dout = round_to(dt, random_values(nq, 14));

  // ---- forward ----
  Ctx cpu{};
  Host cq({B, T, nh, hd}, q), ck({B, T, nkv, hd}, k), cv({B, T, nkv, hd}, v);
  Host c_out({B, T, nh, hd}), clse({B, nh, T});
  attention_forward(cpu, c_out, clse, cq, ck, cv);

  Ctx ctx = gpu_ctx();
  DeviceTensor gq = on_device(dt, {B, T, nh, hd}, q);
  DeviceTensor gk = on_device(dt, {B, T, nkv, hd}, k);
  DeviceTensor gv = on_device(dt, {B, T, nkv, hd}, v);
  DeviceTensor gout = poisoned(dt, {B, T, nh, hd});
  DeviceTensor glse = poisoned(acc, {B, nh, T});
  gpu::synchronize();
  attention_forward(ctx, gout, glse, gq, gk, gv);
  gpu::synchronize();
  expect_close(download(gout), c_out.v, rtol, "forward out");
  expect_close(download(glse), clse.v, rtol_for(acc), "forward lse");

  // ---- backward, from the reference forward's out and lse rounded to the dtype ----
  const std::vector<double> out_r = round_to(dt, c_out.v), lse_r = round_to(acc, clse.v);
  Host cdo({B, T, nh, hd}, dout), cout_r({B, T, nh, hd}, out_r), clse_r({B, nh, T}, lse_r);
  Host cdq({B, T, nh, hd}), cdk({B, T, nkv, hd}), cdv({B, T, nkv, hd});
  attention_backward(cpu, cdq, cdk, cdv, cdo, cq, ck, cv, cout_r, clse_r, Tensor());

  upload(gout, out_r);
  upload(glse, lse_r);
  DeviceTensor gdo = on_device(dt, {B, T, nh, hd}, dout);
  DeviceTensor gdq = poisoned(dt, {B, T, nh, hd});
  DeviceTensor gdk = poisoned(dt, {B, T, nkv, hd});
  DeviceTensor gdv = poisoned(dt, {B, T, nkv, hd});
  // 16-bit backwards get the fp32 dq scratch the model gives them (NaN: the one-pass kernel
  // must write each sum before it reads it).
  DeviceTensor gdq_acc = poisoned(DType::f32, {B, nh, T, hd});
  const Tensor dq_acc = dt == DType::f16 || dt == DType::bf16 ? Tensor(gdq_acc) : Tensor();
  gpu::synchronize();
  attention_backward(ctx, gdq, gdk, gdv, gdo, gq, gk, gv, gout, glse, dq_acc);
  gpu::synchronize();
  const std::vector<double> dq1 = download(gdq), dk1 = download(gdk), dv1 = download(gdv);
  // With one key per query (T = 1) the softmax is constant, so dq and dk are exactly zero and
  // the kernels leave only the rounding of dP - D (O is v rounded): a zero reference is held to
  // the scale of dv, the gradient of the same size that is not zero.
  const auto scale_of = [&](const std::vector<double>& ref) {
    return max_abs(ref) > 0 ? max_abs(ref) : max_abs(cdv.v);
  };
  check_close(dq1, cdq.v, dt, rtol * scale_of(cdq.v), "backward dq");
  check_close(dk1, cdk.v, dt, rtol * scale_of(cdk.v), "backward dk");
  expect_close(dv1, cdv.v, rtol, "backward dv");

  // Deterministic: a second run (over poisoned outputs) gives bitwise the same gradients.
  poison(gdq);
  poison(gdk);
  poison(gdv);
  poison(gdq_acc);
  gpu::synchronize();
  attention_backward(ctx, gdq, gdk, gdv, gdo, gq, gk, gv, gout, glse, dq_acc);
  gpu::synchronize();
  CHECK(download(gdq) == dq1);
  CHECK(download(gdk) == dk1);
  CHECK(download(gdv) == dv1);
}

struct DecodeShape {
  int64_t B, S, nh, nkv, hd;
};

// attention_decode_forward of q [B, nh, hd] over the caches k, v [B, S, nkv, hd] at `lengths`, on
// the CPU (in f64) and on the GPU (into a poisoned output), downloaded.
std::vector<double> cpu_decode(const DecodeShape& d, const std::vector<double>& q,
                               const std::vector<double>& k, const std::vector<double>& v,
                               std::vector<int32_t> lengths) {
  Ctx cpu{};
  Host cq({d.B, d.nh, d.hd}, q), ck({d.B, d.S, d.nkv, d.hd}, k), cv({d.B, d.S, d.nkv, d.hd}, v),
      out({d.B, d.nh, d.hd});
  attention_decode_forward(cpu, out, cq, ck, cv,
                           Tensor(lengths.data(), DType::i32, Device{}, {d.B}));
  return out.v;
}
std::vector<double> gpu_decode(DType dt, const DecodeShape& d, const std::vector<double>& q,
                               const std::vector<double>& k, const std::vector<double>& v,
                               const std::vector<int32_t>& lengths) {
  Ctx ctx = gpu_ctx();
  DeviceTensor gq = on_device(dt, {d.B, d.nh, d.hd}, q);
  DeviceTensor gk = on_device(dt, {d.B, d.S, d.nkv, d.hd}, k);
  DeviceTensor gv = on_device(dt, {d.B, d.S, d.nkv, d.hd}, v);
  DeviceTensor glen(DType::i32, {d.B});
  upload_i32(glen, lengths);
  DeviceTensor gout = poisoned(dt, {d.B, d.nh, d.hd});
  gpu::synchronize();
  attention_decode_forward(ctx, gout, gq, gk, gv, glen);
  gpu::synchronize();
  return download(gout);
}

void check_decode(DType dt, int64_t hd) {
  const int64_t B = 3, S = 40, nh = 4, nkv = 2;
  const std::vector<int32_t> lengths = {37, 1, 23};
  INFO("dtype " << name_of(dt) << ", hd " << hd);
  const double rtol = rtol_for(dt);
  const std::vector<double> q =
      round_to(dt, random_values(static_cast<size_t>(B * nh * hd), 21, -2, 2));
  std::vector<double> k = round_to(dt, random_values(static_cast<size_t>(B * S * nkv * hd), 22));
  std::vector<double> v = round_to(dt, random_values(static_cast<size_t>(B * S * nkv * hd), 23));
  // Entries at or beyond lengths[b] are never to be read: NaN there.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = lengths[static_cast<size_t>(b)]; j < S; ++j)
      for (int64_t e = 0; e < nkv * hd; ++e) {
        const size_t at = static_cast<size_t>((b * S + j) * nkv * hd + e);
        k[at] = v[at] = std::nan("");
      }

  const DecodeShape d{B, S, nh, nkv, hd};
  expect_close(gpu_decode(dt, d, q, k, v, lengths), cpu_decode(d, q, k, v, lengths), rtol,
               "decode out");
}

}  // namespace

TEST_CASE("gpu attention forward/backward match the CPU reference", "[gpu][attention]") {
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16})
    for (int64_t hd : {32, 64}) check_attention(dt, hd);
}

// Longer than the tensor-core kernels' 64-row tiles and not a multiple of them or of the 32-row
// inner tiles: query tiles past the first, key tiles starting past 0 in the dk/dv kernel, and
// warps that skip tiles they cannot see.
TEST_CASE("gpu attention over several tiles matches the CPU reference", "[gpu][attention]") {
  for (DType dt : {DType::f16, DType::bf16, DType::f32}) check_attention(dt, 64, 150);
  // the sm_80+ kernels' two-stage rings over five 64-row tiles and three 128-row query tiles
  check_attention(DType::bf16, 64, 300);
}

// The sm_90 wgmma kernels (attention_sm90.cu) and the sm_80 mma.sync ones in one process:
// MOE_ATTENTION_SM90=0 declines the first (on a device or build without sm_90a both settings run
// the sm_80 kernels), and the sm_90 backward runs as one kernel (attention_sm90_fused_backward.cu,
// MOE_ATTENTION_FUSED_BWD=1; its passes over the query tiles alternating direction, and with
// MOE_ATTENTION_ZIGZAG=0 all one way) and as two (=0). One row (T = 1), the edges of the 64-row
// tiles (63, 64, 65) and of the 128-row blocks (127, 128, 129), several tiles with a ragged end
// (200), a long sequence (1024); GQA (2 and 4 query heads per kv head) and MHA.
TEST_CASE("gpu attention: the sm_90 and sm_80 kernels over tile edges match the CPU reference",
          "[gpu][attention]") {
  const std::string kernel =
      GENERATE(as<std::string>{}, "sm90-fused", "sm90-fused-one-way", "sm90", "sm80");
  setenv("MOE_ATTENTION_SM90", kernel == "sm80" ? "0" : "1", 1);
  setenv("MOE_ATTENTION_FUSED_BWD", kernel.rfind("sm90-fused", 0) == 0 ? "1" : "0", 1);
  setenv("MOE_ATTENTION_ZIGZAG", kernel == "sm90-fused-one-way" ? "0" : "1", 1);
  INFO("kernels " << kernel);
  for (DType dt : {DType::bf16, DType::f16}) {
    for (int64_t T : {1, 63, 64, 65, 127, 128, 129, 200}) {
      check_attention(dt, 64, T, 4, 2);
      check_attention(dt, 64, T, 2, 2);
    }
    check_attention(dt, 64, 1024, 4, 1, 1);
  }
  unsetenv("MOE_ATTENTION_SM90");
  unsetenv("MOE_ATTENTION_FUSED_BWD");
  unsetenv("MOE_ATTENTION_ZIGZAG");
}

// The model gives attention_backward its fp32 dq scratch only where attention_backward_wants_dq_acc
// says so: never for fp32 or a head_dim the tensor-core kernels do not take, never with the
// one-kernel backward or the sm_90 kernels turned off, and where it says yes the backward writes
// the scratch (NaN-poisoned before), where no it leaves it alone. 16 x 8 heads: 128 (batch, kv
// head) chains, enough for the default to choose the one kernel on an H200's 132 SMs; T = 256:
// two key tiles, so the query tiles past the first key tile's diagonal keep sums in the scratch
// (with one key tile every query tile's only share goes straight to dq).
TEST_CASE("gpu attention: the backward wants the dq scratch exactly where it uses it",
          "[gpu][attention]") {
  const int64_t B = 16, T = 256, nh = 8, hd = 64;
  Ctx ctx = gpu_ctx();
  CHECK_FALSE(attention_backward_wants_dq_acc(ctx, DType::f32, B, T, nh, nh, hd));
  CHECK_FALSE(attention_backward_wants_dq_acc(ctx, DType::bf16, B, T, nh, nh, 32));
  Ctx cpu{};
  CHECK_FALSE(attention_backward_wants_dq_acc(cpu, DType::bf16, B, T, nh, nh, hd));
  setenv("MOE_ATTENTION_FUSED_BWD", "0", 1);
  CHECK_FALSE(attention_backward_wants_dq_acc(ctx, DType::bf16, B, T, nh, nh, hd));
  setenv("MOE_ATTENTION_FUSED_BWD", "1", 1);
  setenv("MOE_ATTENTION_SM90", "0", 1);
  CHECK_FALSE(attention_backward_wants_dq_acc(ctx, DType::bf16, B, T, nh, nh, hd));
  unsetenv("MOE_ATTENTION_SM90");
  unsetenv("MOE_ATTENTION_FUSED_BWD");

  const bool wants = attention_backward_wants_dq_acc(ctx, DType::bf16, B, T, nh, nh, hd);
  INFO("wants the scratch: " << wants);
  const size_t n = static_cast<size_t>(B * T * nh * hd);
  auto dev = [&](uint64_t seed) {
    return on_device(DType::bf16, {B, T, nh, hd}, round_to(DType::bf16, random_values(n, seed)));
  };
  DeviceTensor q = dev(61), k = dev(62), v = dev(63), dout = dev(64);
  DeviceTensor out = poisoned(DType::bf16, {B, T, nh, hd}), lse = poisoned(DType::f32, {B, nh, T});
  DeviceTensor dq = poisoned(DType::bf16, {B, T, nh, hd}),
               dk = poisoned(DType::bf16, {B, T, nh, hd});
  DeviceTensor dv = poisoned(DType::bf16, {B, T, nh, hd}),
               acc = poisoned(DType::f32, {B, nh, T, hd});
  attention_forward(ctx, out, lse, q, k, v);
  attention_backward(ctx, dq, dk, dv, dout, q, k, v, out, lse, acc);
  gpu::synchronize();
  const std::vector<double> sums = download(acc);
  const auto written =
      std::count_if(sums.begin(), sums.end(), [](double x) { return !std::isnan(x); });
  if (wants)
    CHECK(written > 0);
  else
    CHECK(written == 0);
  const std::vector<double> g = download(dq);
  CHECK(std::none_of(g.begin(), g.end(), [](double x) { return std::isnan(x); }));
}

// The one-kernel backward's passes alternate direction by default (MOE_ATTENTION_ZIGZAG): dq's
// sums keep their key-tile order, so dq is the same bits as with every pass one way; dk and dv
// add their query tiles in another order (close by expect_close at 1%, not bitwise). T = 1000:
// eight key tiles with a ragged last one, so four passes run backwards; GQA (2 query heads per kv
// head). Where the one kernel does not run (no sm_90a), both settings run the same kernels.
TEST_CASE("gpu attention: the one-kernel backward's dq is the same bits in either pass order",
          "[gpu][attention]") {
  const int64_t B = 3, T = 1000, nh = 4, nkv = 2, hd = 64;
  Ctx ctx = gpu_ctx();
  const size_t nq = static_cast<size_t>(B * T * nh * hd),
               nk = static_cast<size_t>(B * T * nkv * hd);
  auto q_like = [&](uint64_t seed) {
    return on_device(DType::bf16, {B, T, nh, hd}, round_to(DType::bf16, random_values(nq, seed)));
  };
  auto kv_like = [&](uint64_t seed) {
    return on_device(DType::bf16, {B, T, nkv, hd}, round_to(DType::bf16, random_values(nk, seed)));
  };
  DeviceTensor q = q_like(71), k = kv_like(72), v = kv_like(73), dout = q_like(74);
  DeviceTensor out = poisoned(DType::bf16, {B, T, nh, hd}), lse = poisoned(DType::f32, {B, nh, T});
  attention_forward(ctx, out, lse, q, k, v);
  setenv("MOE_ATTENTION_FUSED_BWD", "1", 1);
  struct Grads {
    std::vector<double> dq, dk, dv;
  };
  auto backward = [&](const char* zigzag) {
    setenv("MOE_ATTENTION_ZIGZAG", zigzag, 1);
    DeviceTensor dq = poisoned(DType::bf16, {B, T, nh, hd}),
                 dk = poisoned(DType::bf16, {B, T, nkv, hd}),
                 dv = poisoned(DType::bf16, {B, T, nkv, hd}),
                 acc = poisoned(DType::f32, {B, nh, T, hd});
    attention_backward(ctx, dq, dk, dv, dout, q, k, v, out, lse, acc);
    gpu::synchronize();
    return Grads{download(dq), download(dk), download(dv)};
  };
  const Grads alternating = backward("1"), one_way = backward("0");
  unsetenv("MOE_ATTENTION_ZIGZAG");
  unsetenv("MOE_ATTENTION_FUSED_BWD");
  CHECK(alternating.dq == one_way.dq);
  CHECK(max_abs(one_way.dk) > 0);
  CHECK(max_abs(one_way.dv) > 0);
  expect_close(alternating.dk, one_way.dk, 1e-2, "dk, alternating against one way");
  expect_close(alternating.dv, one_way.dv, 1e-2, "dv, alternating against one way");
}

TEST_CASE("gpu attention handles a head_dim that is not a multiple of 32", "[gpu][attention]") {
  check_attention(DType::f32, 40);
}

TEST_CASE("gpu decode attention matches the CPU reference and reads only lengths[b] entries",
          "[gpu][decode]") {
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16})
    for (int64_t hd : {32, 64}) check_decode(dt, hd);
}

// The SIMT kernels (every dtype's path where the tensor-core kernels do not run: head_dim != 64,
// or f32 / f64) hold a row as NPER values per lane, NPER = 1, 2, 4 or 8 for head_dim up to 32, 64,
// 128 and 256 (attention.cu's dispatch_nper). The cases above reach NPER 1 and 2 only; here
// head_dim 16 (half the lanes idle), 100 and 128 (NPER 4, partial and full), 200 and 256 (NPER 8,
// partial and full), training forward / backward and decode, every dtype.
TEST_CASE("gpu attention and decode at head dims of 4 and 8 values per lane", "[gpu][attention]") {
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16})
    for (int64_t hd : {16, 100, 128, 200, 256}) {
      check_attention(dt, hd);
      check_decode(dt, hd);
    }
}

// A length outside [1, S] is a caller bug the CPU op throws for; the CUDA kernel never reads the
// host's copy, so it writes NaN to every head of that sequence instead of reading past its cache
// (a length of S + 1 would read the next sequence's first entry), and leaves the other sequences
// bitwise as a run with valid lengths gives them.
TEST_CASE("gpu decode: a length outside [1, S] gives NaN rows and leaves the others alone",
          "[gpu][decode]") {
  const int64_t B = 4, S = 40, nh = 4, nkv = 2, hd = 64;
  for (DType dt : {DType::f32, DType::bf16}) {
    INFO("dtype " << name_of(dt));
    const std::vector<double> q =
        round_to(dt, random_values(static_cast<size_t>(B * nh * hd), 41, -2, 2));
    const std::vector<double> k =
        round_to(dt, random_values(static_cast<size_t>(B * S * nkv * hd), 42));
    const std::vector<double> v =
        round_to(dt, random_values(static_cast<size_t>(B * S * nkv * hd), 43));
    const DecodeShape d{B, S, nh, nkv, hd};
    const std::vector<int32_t> valid = {37, 1, static_cast<int32_t>(S), 5};
    const std::vector<double> bad =
        gpu_decode(dt, d, q, k, v, {37, 0, static_cast<int32_t>(S + 1), 5});
    const std::vector<double> good = gpu_decode(dt, d, q, k, v, valid);
    const int64_t row = nh * hd;  // one sequence's heads
    for (int64_t b = 0; b < B; ++b) {
      const bool invalid = b == 1 || b == 2;
      bool ok = true;
      for (int64_t i = b * row; i < (b + 1) * row; ++i)
        ok = ok && (invalid ? std::isnan(bad[static_cast<size_t>(i)])
                            : std::memcmp(&bad[static_cast<size_t>(i)],
                                          &good[static_cast<size_t>(i)], sizeof(double)) == 0);
      INFO("sequence " << b << (invalid ? " (invalid length: NaN expected)" : " (valid length)"));
      CHECK(ok);
    }
    // The valid rows of the good run against the CPU op (so the comparison above is not of two
    // wrong runs).
    expect_close(good, cpu_decode(d, q, k, v, valid), rtol_for(dt), "decode with valid lengths");
  }
}

TEST_CASE("gpu decode equals the last row of the training forward", "[gpu][decode]") {
  // One sequence of T tokens: decode of the last token over the full cache is row T-1 of the
  // forward (both on the GPU, f32).
  const int64_t T = 37, nh = 4, nkv = 2, hd = 64;
  const std::vector<double> q = random_values(static_cast<size_t>(T * nh * hd), 31, -2, 2);
  const std::vector<double> k = random_values(static_cast<size_t>(T * nkv * hd), 32);
  const std::vector<double> v = random_values(static_cast<size_t>(T * nkv * hd), 33);
  Ctx ctx = gpu_ctx();
  DeviceTensor gq = on_device(DType::f32, {1, T, nh, hd}, q);
  DeviceTensor gk = on_device(DType::f32, {1, T, nkv, hd}, k);
  DeviceTensor gv = on_device(DType::f32, {1, T, nkv, hd}, v);
  DeviceTensor gout = poisoned(DType::f32, {1, T, nh, hd});
  DeviceTensor glse = poisoned(DType::f32, {1, nh, T});
  const std::vector<double> q_last(q.end() - nh * hd, q.end());
  DeviceTensor dq = on_device(DType::f32, {1, nh, hd}, q_last);
  DeviceTensor dlen(DType::i32, {1});
  upload_i32(dlen, {static_cast<int32_t>(T)});
  DeviceTensor dout = poisoned(DType::f32, {1, nh, hd});
  gpu::synchronize();
  attention_forward(ctx, gout, glse, gq, gk, gv);
  attention_decode_forward(ctx, dout, dq, gk, gv, dlen);
  gpu::synchronize();
  const std::vector<double> full = download(gout);
  const std::vector<double> last(full.end() - nh * hd, full.end());
  expect_close(download(dout), last, 2e-6, "decode vs forward row T-1");
}

TEST_CASE("gpu attention: the lse of 16-bit inputs must be f32", "[gpu][attention]") {
  const int64_t B = 1, T = 5, nh = 2, hd = 32;
  Ctx ctx = gpu_ctx();
  DeviceTensor q(DType::bf16, {B, T, nh, hd}), out(DType::bf16, {B, T, nh, hd});
  DeviceTensor lse16(DType::bf16, {B, nh, T});
  CHECK_THROWS_WITH(attention_forward(ctx, out, lse16, q, q, q),
                    Catch::Contains("attention_forward: lse: dtype bf16, expected f32"));
  CHECK_THROWS_WITH(attention_backward(ctx, out, out, out, out, q, q, q, out, lse16, Tensor()),
                    Catch::Contains("attention_backward: lse"));
}
