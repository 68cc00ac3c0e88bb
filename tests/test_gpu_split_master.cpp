// The split fp32 master (train.split_master) on the GPU:
//  - adamw_step_split stores bitwise the master, m and v of the CUDA adamw_step on the same fp32
//    state, in the vectorised kernel (aligned arrays, n % 4 tail) and the one-element kernel (the
//    arrays one element in), also clipped by norm_sq; a non-finite norm leaves hi, lo, m, v; it
//    agrees with the CPU op within the AdamW tolerance (fp32 math against double);
//  - split_master_decode is bitwise the host decode;
//  - a bf16 Model with a split master holds bitwise the fp32 master of the plain model after the
//    same init (master_to_host), its compute copy differs only at ties, and the decoded fp32
//    copies of the routers are their master; from a master without ties a training step is
//    bitwise the plain model's (loss, master, moments), later steps track it, and
//    master_to_host / master_from_host move it exactly into a fresh split model and a plain one;
//  - a training run with a split master tracks the plain bf16 run and resumes from its checkpoint
//    bitwise;
//  - with bf16 expert gradients (train.bf16_expert_grads) AdamW takes a bf16 g as that g in f32,
//    a backward's expert gradients are the f32 ones rounded and every other gradient and the
//    loss are bitwise the f32 model's; a run tracks the f32 one and resumes bitwise.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <vector>

#include "catch.hpp"
#include "common/split_master.hpp"
#include "gpu_test_util.hpp"
#include "moe/model.hpp"
#include "moe/ops/linear.hpp"
#include "moe/ops/elementwise.hpp"
#include "moe/ops/optim.hpp"
#include "moe/optim.hpp"
#include "moe/rng.hpp"
#include "moe/trainer.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;

namespace {

// hi / lo device tensors encoding p (n values), placed `shift` elements into their buffers.
struct DeviceSplit {
  Buffer hi_buf, lo_buf;
  Tensor hi, lo;
  DeviceSplit(const std::vector<float>& p, int64_t shift)
      : hi_buf(gpu0(), (p.size() + shift) * 2), lo_buf(gpu0(), (p.size() + shift) * 2) {
    std::vector<uint16_t> h(p.size() + shift, 0x7FC0), l(p.size() + shift, 0x1234);
    for (size_t i = 0; i < p.size(); ++i)
      split_master_encode_one(p[i], &h[i + shift], &l[i + shift]);
    const auto total = static_cast<int64_t>(h.size()), n = static_cast<int64_t>(p.size());
    hi = Tensor(hi_buf.data(), DType::bf16, gpu0(), {total}).rows(shift, shift + n);
    lo = Tensor(lo_buf.data(), DType::u16, gpu0(), {total}).rows(shift, shift + n);
    copy_from_host(Tensor(hi_buf.data(), DType::bf16, gpu0(), {total}), h.data());
    copy_from_host(Tensor(lo_buf.data(), DType::u16, gpu0(), {total}), l.data());
  }
  std::vector<float> decoded() const {
    std::vector<uint16_t> h(static_cast<size_t>(hi.numel())), l(h.size());
    copy_to_host(h.data(), hi);
    copy_to_host(l.data(), lo);
    std::vector<float> p(h.size());
    for (size_t i = 0; i < p.size(); ++i) p[i] = split_master_decode_one(h[i], l[i]);
    return p;
  }
};

std::vector<float> as_floats(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

std::vector<float> downloaded_floats(Tensor t) {
  return as_floats(download(t));
}

DeviceTensor offsets_on_device(const std::vector<int32_t>& v) {
  DeviceTensor t(DType::i32, {static_cast<int64_t>(v.size())});
  upload_i32(t, v);
  return t;
}

// One update's random state (f32 values; g of g_dtype's) and its arguments, from `seed`.
struct UpdateInputs {
  std::vector<double> p0, g, m0, v0;
  AdamWArgs a;
  UpdateInputs(int64_t n, uint64_t seed, long step, DType g_dtype)
      : p0(round_to(DType::f32, random_values(n, seed, -2.0, 2.0))),
        g(round_to(g_dtype, random_values(n, seed + 1, -3.0, 3.0))),
        m0(round_to(DType::f32, random_values(n, seed + 2, -0.1, 0.1))),
        v0(round_to(DType::f32, random_values(n, seed + 3, 1e-3, 0.1))) {
    a.lr = 1e-2, a.beta1 = 0.9, a.beta2 = 0.95, a.weight_decay = 0.1, a.step = step;
    a.grad_scale = 0.5;
  }
};

}  // namespace

TEST_CASE("gpu adamw_step_split: the CUDA adamw_step's master bit for bit", "[gpu][optim]") {
  const int64_t n = 4099;
  const UpdateInputs in(n, 81, 2, DType::f32);
  const std::vector<double>&p0 = in.p0, &g = in.g, &m0 = in.m0, &v0 = in.v0;
  const AdamWArgs& a = in.a;
  for (int64_t shift : {0, 1}) {  // vectorised (+ tail), one element per thread
    for (double max_norm : {0.0, 1.0}) {
      INFO("shift " << shift << " max_norm " << max_norm);
      Ctx ctx = gpu_ctx();
      DeviceTensor p = on_device(DType::f32, {n}, p0), gd = on_device(DType::f32, {n}, g);
      DeviceTensor m = on_device(DType::f32, {n}, m0), v = on_device(DType::f32, {n}, v0);
      DeviceTensor sm = on_device(DType::f32, {n}, m0), sv = on_device(DType::f32, {n}, v0);
      DeviceTensor norm_sq = on_device(DType::f64, {1}, {0.0});
      AdamWArgs aa = a;
      if (max_norm > 0) {
        sum_squares(ctx, norm_sq, gd);
        aa.norm_sq = norm_sq;
        aa.max_norm = max_norm;
      }
      DeviceSplit s(as_floats(p0), shift);
      adamw_step(ctx, p, gd, m, v, aa);
      adamw_step_split(ctx, s.hi, s.lo, gd, sm, sv, aa);
      gpu::synchronize();
      CHECK(s.decoded() == downloaded_floats(p));
      CHECK(download(sm) == download(m));
      CHECK(download(sv) == download(v));

      // The CPU split op on the same state: fp32 against double math (rtol 1e-6 as for AdamW).
      Ctx cpu = make_ctx(Device{});
      std::vector<uint16_t> h(n), l(n);
      for (int64_t i = 0; i < n; ++i)
        split_master_encode_one(static_cast<float>(p0[i]), &h[i], &l[i]);
      std::vector<float> cg = as_floats(g), cm = as_floats(m0), cv = as_floats(v0);
      Buf<double> cnorm({1});
      AdamWArgs ca = a;
      if (max_norm > 0) {
        cnorm.v[0] = download(norm_sq)[0];
        ca.norm_sq = cnorm;
        ca.max_norm = max_norm;
      }
      adamw_step_split(cpu, Tensor(h.data(), DType::bf16, Device{}, {n}),
                       Tensor(l.data(), DType::u16, Device{}, {n}),
                       Tensor(cg.data(), DType::f32, Device{}, {n}),
                       Tensor(cm.data(), DType::f32, Device{}, {n}),
                       Tensor(cv.data(), DType::f32, Device{}, {n}), ca);
      std::vector<double> cpu_p(n);
      for (int64_t i = 0; i < n; ++i) cpu_p[i] = split_master_decode_one(h[i], l[i]);
      const std::vector<float> gpu_p = s.decoded();
      CHECK(worst_ratio(std::vector<double>(gpu_p.begin(), gpu_p.end()), cpu_p, 1e-6, 1e-9) <= 1);
    }
  }
}

TEST_CASE("gpu adamw_step_split: a bf16 g updates as the same g in f32", "[gpu][optim]") {
  // train.bf16_expert_grads: the experts' gradients arrive in bf16 (8-byte quads of g).
  const int64_t n = 4099;
  const UpdateInputs in(n, 181, 3, DType::bf16);
  const std::vector<double>&p0 = in.p0, &g = in.g, &m0 = in.m0, &v0 = in.v0;
  const AdamWArgs& a = in.a;
  for (int64_t shift : {0, 1}) {  // vectorised (+ tail), one element per thread
    INFO("shift " << shift);
    Ctx ctx = gpu_ctx();
    DeviceTensor g32 = on_device(DType::f32, {n}, g), g16 = on_device(DType::bf16, {n}, g);
    DeviceTensor m = on_device(DType::f32, {n}, m0), v = on_device(DType::f32, {n}, v0);
    DeviceTensor m16 = on_device(DType::f32, {n}, m0), v16 = on_device(DType::f32, {n}, v0);
    DeviceTensor sq32 = on_device(DType::f64, {1}, {0.0}), sq16 = on_device(DType::f64, {1}, {0.0});
    DeviceSplit s32(as_floats(p0), shift), s16(as_floats(p0), shift);
    AdamWArgs a32 = a, a16 = a;
    a32.grad_sq_out = sq32;
    a16.grad_sq_out = sq16;
    adamw_step_split(ctx, s32.hi, s32.lo, g32, m, v, a32);
    adamw_step_split(ctx, s16.hi, s16.lo, g16, m16, v16, a16);
    gpu::synchronize();
    CHECK(s16.decoded() == s32.decoded());
    CHECK(s16.decoded() != as_floats(p0));  // the update ran
    CHECK(download(m16) == download(m));
    CHECK(download(v16) == download(v));
    double want = 0;
    for (double x : g) want += x * x;
    CHECK(download(sq16)[0] == Approx(want).epsilon(1e-12));
    CHECK(download(sq32)[0] == Approx(want).epsilon(1e-12));
  }
}

TEST_CASE("gpu adamw_step_split: a non-finite norm leaves everything; decode is the host's",
          "[gpu][optim]") {
  const int64_t n = 1027;
  Ctx ctx = gpu_ctx();
  const std::vector<float> p0 = as_floats(round_to(DType::f32, random_values(n, 91, -4.0, 4.0)));
  DeviceSplit s(p0, 0);
  DeviceTensor g = on_device(DType::f32, {n}, random_values(n, 92));
  DeviceTensor m = on_device(DType::f32, {n}, random_values(n, 93, -0.1, 0.1));
  DeviceTensor v = on_device(DType::f32, {n}, random_values(n, 94, 1e-3, 0.1));
  DeviceTensor norm_sq = on_device(DType::f64, {1}, {std::numeric_limits<double>::infinity()});
  const std::vector<unsigned char> hi0 = bytes_of(s.hi), lo0 = bytes_of(s.lo);
  const std::vector<double> m0 = download(m), v0 = download(v);
  AdamWArgs a;
  a.step = 3, a.norm_sq = norm_sq, a.max_norm = 1.0;
  adamw_step_split(ctx, s.hi, s.lo, g, m, v, a);
  gpu::synchronize();
  CHECK(bytes_of(s.hi) == hi0);
  CHECK(bytes_of(s.lo) == lo0);
  CHECK(download(m) == m0);
  CHECK(download(v) == v0);

  DeviceTensor out = poisoned(DType::f32, {n});
  split_master_decode(ctx, out, s.hi, s.lo);
  gpu::synchronize();
  CHECK(downloaded_floats(out) == p0);
  CHECK(s.decoded() == p0);
}

// grouped_linear_forward_adamw: on sm_90 the split update rides in the product's spare warps
// (256- and 128-column tiles, ping-pong, multicast) and a finishing kernel takes what they left;
// with the sm_90 kernels off, or a slab of no whole quads, the two ops run in turn. Every way gives
// the bits of the two ops in turn (y, hi, lo, m, v), y matches the CPU product and the master the
// CPU update.
TEST_CASE("gpu grouped_linear_forward_adamw: the bits of the product and the update in turn",
          "[gpu][optim]") {
  const std::string kernel = GENERATE(as<std::string>{}, "256", "128", "pingpong", "multicast",
                                      "pingpong-multicast", "256-deferred", "0");
  set_grouped_sm90(kernel);
  const int64_t e = 5, in = 192, out = 320;
  const std::vector<int32_t> offsets = {0, 300, 300, 517, 900, 1031};
  const int64_t r = offsets.back();
  const DType dt = DType::bf16;
  const auto x = rounded_random_values(dt, r * in, 101),
             w = rounded_random_values(dt, e * out * in, 102);
  AdamWArgs a;
  a.lr = 1e-2, a.beta1 = 0.9, a.beta2 = 0.95, a.weight_decay = 0.1, a.step = 3;
  // Quads over many tickets (the riders and the finisher share them), and a slab with a tail.
  for (const int64_t n : {int64_t(3) << 18, int64_t(4099)}) {
    INFO("MOE_GROUPED_SM90=" << kernel << " n " << n);
    Ctx ctx = gpu_ctx();
    const std::vector<float> p0 = as_floats(round_to(DType::f32, random_values(n, 103, -2, 2)));
    const std::vector<double> g = round_to(DType::f32, random_values(n, 104, -3, 3));
    const std::vector<double> m0 = round_to(DType::f32, random_values(n, 105, -0.1, 0.1));
    const std::vector<double> v0 = round_to(DType::f32, random_values(n, 106, 1e-3, 0.1));
    DeviceTensor gx = on_device(dt, {r, in}, x), gw = on_device(dt, {e, out, in}, w);
    DeviceTensor off = offsets_on_device(offsets), gg = on_device(DType::f32, {n}, g);
    // carried (or in turn inside the op) ...
    DeviceSplit s1(p0, 0);
    DeviceTensor y1 = poisoned(dt, {r, out});
    DeviceTensor m1 = on_device(DType::f32, {n}, m0), v1 = on_device(DType::f32, {n}, v0);
    grouped_linear_forward_adamw(ctx, y1, gx, gw, off, s1.hi, s1.lo, gg, m1, v1, a);
    // ... against the two ops in turn
    DeviceSplit s2(p0, 0);
    DeviceTensor y2 = poisoned(dt, {r, out});
    DeviceTensor m2 = on_device(DType::f32, {n}, m0), v2 = on_device(DType::f32, {n}, v0);
    grouped_linear_forward(ctx, y2, gx, gw, off);
    adamw_step_split(ctx, s2.hi, s2.lo, gg, m2, v2, a);
    gpu::synchronize();
    CHECK(bytes_of(y1) == bytes_of(y2));
    CHECK(bytes_of(s1.hi) == bytes_of(s2.hi));
    CHECK(bytes_of(s1.lo) == bytes_of(s2.lo));
    CHECK(bytes_of(m1) == bytes_of(m2));
    CHECK(bytes_of(v1) == bytes_of(v2));

    // The CPU op: the product within bf16 sums, the master within AdamW's fp32 tolerance.
    Ctx cpu = make_ctx(Device{});
    std::vector<double> hx = x, hw = w, hy(static_cast<size_t>(r * out));
    std::vector<int32_t> hoff = offsets;
    std::vector<uint16_t> h(n), l(n);
    for (int64_t i = 0; i < n; ++i) split_master_encode_one(p0[i], &h[i], &l[i]);
    std::vector<float> cg = as_floats(g), cm = as_floats(m0), cv = as_floats(v0);
    cpu::grouped_linear_forward_adamw(
        cpu, Tensor(hy.data(), DType::f64, Device{}, {r, out}),
        Tensor(hx.data(), DType::f64, Device{}, {r, in}),
        Tensor(hw.data(), DType::f64, Device{}, {e, out, in}),
        Tensor(hoff.data(), DType::i32, Device{}, {e + 1}),
        Tensor(h.data(), DType::bf16, Device{}, {n}), Tensor(l.data(), DType::u16, Device{}, {n}),
        Tensor(cg.data(), DType::f32, Device{}, {n}), Tensor(cm.data(), DType::f32, Device{}, {n}),
        Tensor(cv.data(), DType::f32, Device{}, {n}), a);
    check_grad(download(y1), hy, dt, "grouped_linear_forward_adamw y");
    std::vector<double> cpu_p(n);
    for (int64_t i = 0; i < n; ++i) cpu_p[i] = split_master_decode_one(h[i], l[i]);
    const std::vector<float> gpu_p = s1.decoded();
    // (atol 1e-6, 4 ulp of |p| <= 2: the fp32 update over 786,432 elements, in turn too, has a
    // worst element 1.2e-6 off by rtol 1e-6 alone)
    CHECK(worst_ratio(std::vector<double>(gpu_p.begin(), gpu_p.end()), cpu_p, 1e-6, 1e-6) <= 1);
  }
  clear_grouped_sm90();
}

TEST_CASE("gpu grouped_linear_forward_adamw: a slab overlapping the product throws",
          "[gpu][optim]") {
  Ctx ctx = gpu_ctx();
  const int64_t n = 64;
  DeviceTensor x = on_device(DType::bf16, {4, 16}, random_values(64, 107));
  DeviceTensor w = on_device(DType::bf16, {1, 8, 16}, random_values(128, 108));
  DeviceTensor y = poisoned(DType::bf16, {4, 8}), off = offsets_on_device({0, 4});
  DeviceSplit s(as_floats(random_values(n, 109)), 0);
  DeviceTensor g = on_device(DType::f32, {n}, random_values(n, 110));
  DeviceTensor m = on_device(DType::f32, {n}, random_values(n, 111));
  DeviceTensor v = on_device(DType::f32, {n}, random_values(n, 112, 0.1, 1.0));
  Tensor hi_as_x = Tensor(s.hi.data, DType::bf16, gpu0(), {4, 16});
  CHECK_THROWS_WITH(
      grouped_linear_forward_adamw(ctx, y, hi_as_x, w, off, s.hi, s.lo, g, m, v, AdamWArgs{}),
      Catch::Contains("overlap the product"));
}

namespace {

ModelConfig tiny_model() {
  ModelConfig m;
  m.vocab_size = 61;
  m.hidden_size = 64;
  m.intermediate_size = 48;
  m.dense_intermediate_size = 80;
  m.num_hidden_layers = 4;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.max_position_embeddings = 64;
  m.num_local_experts = 8;
  m.num_experts_per_tok = 2;
  m.num_shared_experts = 1;
  m.shared_expert_intermediate_size = 32;
  m.moe_layer_freq = 2;
  m.mod.enabled = true;
  m.mod.every = 2;
  m.mod.capacity = 0.5;
  m.mod.predictor_hidden_size = 16;
  return m;
}

std::vector<float> master_of(const Model& model) {
  std::vector<float> v(model.table().total);
  model.master_to_host(0, v.size(), v.data());
  return v;
}

std::vector<uint16_t> compute_copy_of(const Model& model) {
  std::vector<uint16_t> v(model.table().total);
  copy_to_host(v.data(), model.compute_params());
  return v;
}

}  // namespace

TEST_CASE("gpu model: a split master is the plain model's master, and moves exactly",
          "[gpu][model][mixed]") {
  const ModelConfig m = tiny_model();
  const int b = 2, t = 32;
  MemoryPlan split_plan;
  split_plan.split_master = true;
  Ctx ctx = gpu_ctx();
  Model split(m, DType::bf16, gpu0(), b, t, true, split_plan), plain(m, DType::bf16, gpu0(), b, t);
  split.init_weights(5);
  plain.init_weights(5);
  REQUIRE(split.splits_master());
  CHECK(split.weight_bytes() < plain.weight_bytes());
  std::vector<float> master0 = master_of(plain);
  CHECK(master_of(split) == master0);
  // The compute copies differ exactly where the master's low half is a tie.
  auto check_copies_differ_at_ties_only = [&](const std::vector<float>& master) {
    const std::vector<uint16_t> sc = compute_copy_of(split), pc = compute_copy_of(plain);
    size_t ties = 0, differ = 0, differ_off_tie = 0;
    for (size_t i = 0; i < master.size(); ++i) {
      const bool tie = (split_float_bits(master[i]) & 0xFFFFu) == 0x8000u;
      ties += tie;
      differ += sc[i] != pc[i];
      differ_off_tie += sc[i] != pc[i] && !tie;
    }
    INFO(ties << " ties among " << master.size() << " weights");
    CHECK(differ_off_tie == 0);
    CHECK(differ <= ties);
    return ties;
  };
  check_copies_differ_at_ties_only(master0);
  // The routers' fp32 copies are their master.
  for (const ParamInfo& p : split.table().params) {
    if (!p.fp32_reads) continue;
    INFO(p.name);
    const std::vector<float> copy = downloaded_floats(split.param(p));
    CHECK(copy ==
          std::vector<float>(master0.begin() + p.offset, master0.begin() + p.offset + p.numel()));
  }

  // Without ties the two compute copies are equal, so one step is bitwise the plain model's.
  for (float& x : master0)
    if ((split_float_bits(x) & 0xFFFFu) == 0x8000u) x = split_bits_float(split_float_bits(x) + 1);
  for (Model* to : {&split, &plain}) {
    to->master_from_host(0, master0.size(), master0.data());
    to->weights_changed(ctx);
  }
  REQUIRE(check_copies_differ_at_ties_only(master0) == 0);
  REQUIRE(bytes_of(split.compute_params()) == bytes_of(plain.compute_params()));

  OptimizerConfig oc;
  AdamW split_opt(oc, split), plain_opt(oc, plain);
  Buffer norm(gpu0(), sizeof(double));
  for (int step = 0; step < 3; ++step) {
    const auto ids = tokens(b * t, m.vocab_size, 40 + step);
    const auto tg = tokens(b * t, m.vocab_size, 50 + step);
    auto run = [&](Model& model, AdamW& opt) {
      model.zero_grads(ctx);
      model.reset_stats(ctx);
      model.upload_batch(ctx, ids.data(), tg.data());
      model.queue_forward_backward(ctx, 1.0);
      queue_grad_norm_sq(ctx, model, norm.as(DType::f64, {1}));
      opt.step(ctx, model, 1e-3, 1.0, norm.as(DType::f64, {1}), 1.0);
      model.weights_changed(ctx, opt.writes_compute_copy(model));
      return model.read_stats(ctx);
    };
    const Losses ls = run(split, split_opt), lp = run(plain, plain_opt);
    INFO("step " << step << ": loss " << ls.lm << " vs " << lp.lm);
    if (step == 0) {
      CHECK(ls.lm == lp.lm);
      const std::vector<float> ms = master_of(split);
      CHECK(ms == master_of(plain));
      CHECK(bytes_of(split_opt.moment1()) == bytes_of(plain_opt.moment1()));
      CHECK(bytes_of(split_opt.moment2()) == bytes_of(plain_opt.moment2()));
      REQUIRE(ms != master0);  // the step moved the weights
      check_copies_differ_at_ties_only(ms);
    } else {
      // New ties make the forwards differ a little (Adam's first steps move a weight by about
      // lr whatever its gradient's size, so the masters are compared through the loss).
      CHECK(std::fabs(ls.lm - lp.lm) <= 1e-3 * lp.lm);
    }
  }

  // master_to_host -> master_from_host: bitwise into a fresh split model and a plain one.
  const std::vector<float> ms = master_of(split);
  Model split2(m, DType::bf16, gpu0(), b, t, true, split_plan),
      plain2(m, DType::bf16, gpu0(), b, t);
  for (Model* to : {&split2, &plain2}) {
    const size_t half = ms.size() / 2;  // in two ranges, as checkpoints move it in chunks
    to->master_from_host(0, half, ms.data());
    to->master_from_host(half, ms.size(), ms.data() + half);
    to->weights_changed(ctx);
    CHECK(master_of(*to) == ms);
  }
  CHECK(bytes_of(split2.compute_params()) == bytes_of(split.compute_params()));
  CHECK(bytes_of(split2.master_low()) == bytes_of(split.master_low()));
  CHECK_THROWS_WITH(split.params(), Catch::Contains("the master is split"));
}

namespace {

Config split_run(const std::string& out_dir, bool split) {
  Config c = parse_config(
      "{}",
      {"train_micro_batch_size_per_gpu=4", "model.vocab_size=61", "model.hidden_size=64",
       "model.intermediate_size=48", "model.num_hidden_layers=4", "model.num_attention_heads=4",
       "model.num_key_value_heads=2", "model.max_position_embeddings=64",
       "model.num_local_experts=8", "model.num_shared_experts=1", "model.moe_layer_freq=2",
       "model.mod={\"enabled\": true, \"every\": 2, \"capacity\": 0.5}", "data.seq_len=32",
       "optimizer.params.lr=3e-3", "train.max_steps=8", "train.log_interval=10",
       "train.eval_batches=1", "train.save_interval=4", "bf16.enabled=true"},
      "test");
  c.train.device = "cuda";
  c.train.out_dir = out_dir;
  c.train.split_master = split;
  return c;
}

// Trains config(dir) for 8 steps: its losses within rel_tol of `reference`'s (relative), it
// learns, and a run of it killed right after its step-4 checkpoint resumes bitwise. Returns the
// first run.
TrainResult check_tracks_and_resumes(const std::function<Config(const std::string&)>& config,
                                     const TrainResult& reference, double rel_tol,
                                     std::ostream& log_out) {
  TempDir dir, resumed_dir;
  std::ostringstream log;
  const TrainResult run = train(config(dir.path.string()), log);
  REQUIRE(reference.losses.size() == 8);
  REQUIRE(run.losses.size() == 8);
  double worst = 0;
  for (size_t i = 0; i < 8; ++i)
    worst = std::max(worst, std::fabs(run.losses[i] - reference.losses[i]) / reference.losses[i]);
  INFO("worst relative loss difference " << worst << "\n" << log.str());
  CHECK(worst < rel_tol);
  CHECK(run.losses.back() < run.losses.front() - 0.02);  // it learns

  TrainOptions stop;
  stop.stop_after_step = 4;  // killed right after the step-4 checkpoint
  train(config(resumed_dir.path.string()), log, stop);
  Config again = config(resumed_dir.path.string());
  again.train.resume = "auto";
  const TrainResult resumed = train(again, log);
  CHECK(resumed.resumed_from == 4);
  REQUIRE(resumed.losses.size() == 4);
  for (int i = 0; i < 4; ++i) {
    INFO("step " << i + 5);
    CHECK(resumed.losses[i] == run.losses[i + 4]);  // bitwise
  }
  log_out << log.str();
  return run;
}

}  // namespace

TEST_CASE("gpu train: a split master tracks the plain bf16 run and resumes bitwise",
          "[gpu][train][mixed]") {
  TempDir plain_dir;
  std::ostringstream log;
  const TrainResult plain = train(split_run(plain_dir.path.string(), false), log);
  check_tracks_and_resumes([](const std::string& dir) { return split_run(dir, true); }, plain, 1e-3,
                           log);
}

TEST_CASE("gpu model: bf16 expert gradients are the f32 ones rounded; the rest bitwise",
          "[gpu][model][mixed]") {
  // train.bf16_expert_grads: only the expert stacks' gradients change (to bf16); nothing in the
  // backward reads them, so every other gradient, and the loss, is bitwise the f32 model's.
  const ModelConfig m = tiny_model();
  const int b = 2, t = 32;
  MemoryPlan f32_plan, bf16_plan;
  f32_plan.split_master = bf16_plan.split_master = true;
  bf16_plan.bf16_expert_grads = true;
  Ctx ctx = gpu_ctx();
  Model wide(m, DType::bf16, gpu0(), b, t, true, f32_plan),
      narrow(m, DType::bf16, gpu0(), b, t, true, bf16_plan);
  wide.init_weights(7);
  narrow.init_weights(7);
  CHECK(narrow.grad_bytes() < wide.grad_bytes());
  CHECK_THROWS_WITH(narrow.grads(), Catch::Contains("train.bf16_expert_grads"));
  size_t stacks = 0;
  for (const ParamInfo& p : narrow.table().params) {
    CHECK(narrow.grad_dtype(p) == (p.stack > 1 ? DType::bf16 : DType::f32));
    stacks += p.stack > 1;
  }
  REQUIRE(stacks > 0);
  OptimizerConfig oc;
  AdamW wide_opt(oc, wide), narrow_opt(oc, narrow);
  Buffer norm_w(gpu0(), sizeof(double)), norm_n(gpu0(), sizeof(double));
  for (int step = 0; step < 3; ++step) {
    const auto ids = tokens(b * t, m.vocab_size, 60 + step);
    const auto tg = tokens(b * t, m.vocab_size, 70 + step);
    // Step 0 clears every gradient first (the experts' too: their backward then adds onto
    // zeros); later steps leave the expert stacks to the backward to write, as training does.
    auto run = [&](Model& model) {
      model.zero_grads(ctx, /*experts_by_backward=*/step > 0);
      model.reset_stats(ctx);
      model.upload_batch(ctx, ids.data(), tg.data());
      model.queue_forward_backward(ctx, 1.0);
      return model.read_stats(ctx);
    };
    const Losses lw = run(wide), ln = run(narrow);
    INFO("step " << step << ": loss " << ln.lm << " vs " << lw.lm);
    if (step == 0) {
      CHECK(ln.lm == lw.lm);
      size_t exact = 0, count = 0;
      for (const ParamInfo& p : narrow.table().params) {
        INFO(p.name);
        const std::vector<double> gw = download(wide.grad(p)), gn = download(narrow.grad(p));
        if (p.stack == 1) {
          CHECK(gn == gw);
          continue;
        }
        // One rounding of the f32 sum (a tile split into chunks rounds once per chunk).
        double worst = 0, scale = 0;
        for (double x : gw) scale = std::max(scale, std::fabs(x));
        REQUIRE(scale > 0);
        for (size_t i = 0; i < gw.size(); ++i) {
          worst = std::max(worst, std::fabs(gn[i] - gw[i]) / (std::fabs(gw[i]) + 1e-3 * scale));
          exact += gn[i] == round_to(DType::bf16, {gw[i]})[0];
          ++count;
        }
        CHECK(worst <= 1.0 / 128);
      }
      CHECK(exact >= count * 9 / 10);
    } else {
      CHECK(std::fabs(ln.lm - lw.lm) <= 5e-3 * lw.lm);
    }
    queue_grad_norm_sq(ctx, wide, norm_w.as(DType::f64, {1}));
    queue_grad_norm_sq(ctx, narrow, norm_n.as(DType::f64, {1}));
    double nw = 0, nn = 0;
    copy_to_host(&nw, norm_w.as(DType::f64, {1}));
    copy_to_host(&nn, norm_n.as(DType::f64, {1}));
    CHECK(std::sqrt(nn) == Approx(std::sqrt(nw)).epsilon(1e-2));
    wide_opt.step(ctx, wide, 1e-3, 1.0, norm_w.as(DType::f64, {1}), 1.0);
    narrow_opt.step(ctx, narrow, 1e-3, 1.0, norm_n.as(DType::f64, {1}), 1.0);
    wide.weights_changed(ctx, wide_opt.writes_compute_copy(wide));
    narrow.weights_changed(ctx, narrow_opt.writes_compute_copy(narrow));
  }
}

TEST_CASE("gpu train: bf16 expert gradients track the f32 ones and resume bitwise",
          "[gpu][train][mixed]") {
  TempDir wide_dir;
  std::ostringstream log;
  const TrainResult wide = train(split_run(wide_dir.path.string(), true), log);
  const TrainResult narrow = check_tracks_and_resumes(
      [](const std::string& dir) {
        Config c = split_run(dir, true);
        c.train.bf16_expert_grads = true;
        return c;
      },
      wide, 5e-3, log);
  CHECK(narrow.losses.at(0) == wide.losses.at(0));  // the first forward sees the same weights
}
