// Hopper (sm_90a) grouped GEMMs with wgmma and TMA: the first path of grouped_mma_rows /
// grouped_mma_dw (grouped_mma.cuh) on an sm_90 device, ahead of the mma.sync kernels of
// grouped_mma_sm80.cu, which stay for sm_80 / sm_89 and for every case this file declines.
//
// Why it is fast: a warpgroup (4 warps) issues one asynchronous m64nNk16 MMA that reads both
// operands straight from shared memory, and the operands get there by TMA (the tensor memory
// accelerator copies a whole box per instruction, zero-fills what lies outside the tensor and
// writes the 128-byte swizzle the MMA reads), so the math warps issue almost nothing else.
//
// A block: 3 warpgroups (384 threads). Warpgroup 0 produces: one thread issues the TMA loads of
// each 64-wide k-slice into a kStages-deep ring of shared-memory stages, each guarded by a "full"
// and an "empty" barrier (tma_sm90.cuh). Warpgroups 1 and 2 compute a 128 x kBN output tile
// (warpgroup g owns rows 64g..64g+63, all kBN columns: m64nkBNk16): wait for a stage to be full,
// issue its four wgmma, and free the stage before once its wgmma have retired (one group in
// flight). Operand tiles keep the operand's global major-ness, read through wgmma's transpose
// bits, so the three products share one loop:
//   y  = x w_e^T        A = x [R, in] K-major      B(k, n) = w_e[n, k] K-major    rows kernel
//   dx = dy w_e         A = dy [R, out] K-major    B(k, n) = w_e[k, n] N-major    rows kernel
//   dw_e += dy_e^T x_e  A(m, k) = dy[k, m] M-major B(k, n) = x[k, n] N-major      dw kernel
// A K-major tile is kMN rows of 64 k (128 bytes); an MN-major tile is kMN / 64 blocks of 64 k-rows
// of 64 m/n-elements, 8 KiB apart. TMA needs 16-byte aligned bases and leading dimensions that
// are multiples of 8 elements (the sm_80 kernels' requirements too).
//
// Rows kernel: persistent, one block per SM walking (row tile, column tile) pairs, columns
// fastest (blocks resident together share their A row tiles and the expert's weights in L2);
// row tiles are cut per expert on the device (grouped_tiles.cuh). dw kernel: persistent too, over
// (expert, chunk of its rows, tile) units; a hot expert's rows are split into chunks that add in
// a fixed order (flags), so every output element gets its reductions from one thread per chunk,
// in chunk order: deterministic. Two other schedules (Sched, MOE_GROUPED_SM90): ping-pong (the
// math warpgroups on alternate whole tiles, one's epilogue under the other's main loop) and
// multicast (rows kernels in clusters of two blocks sharing each B slice by TMA multicast).
//
// Files: grouped_sm90_parts.cuh (configurations, the ring and its barriers, the main loops, the
// epilogue's stores, the gathering copies), grouped_sm90_rows.cuh and grouped_sm90_dw.cuh (the
// kernels); this one: tensor maps, launches, the schedule switch and the entry points.
//
// Which code runs: the kernels' bodies exist only in sm_90a code (kHasWgmma). The top
// CMakeLists.txt builds MOE_CUDA_ARCHS entry 90 as sm_90a machine code (no compute_90 PTX) and
// then defines MOE_WITH_SM90A; with it, a kernel whose code for this device is version 9.0 on an
// sm_90 device is the sm_90a code, and the host launches these kernels. Otherwise they decline.
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>

#include "cuda/grouped_mma.cuh"
#include "cuda/grouped_sm90_dw.cuh"
#include "cuda/grouped_sm90_parts.cuh"
#include "cuda/grouped_sm90_rows.cuh"
#include "moe/env_switch.hpp"

namespace moe::cuda_detail {
namespace {

using namespace grouped_sm90;

// A tensor map over a row-major 16-bit tensor of `rank` (2 or 3) dimensions, innermost first:
// dims[i] elements, strides[i] elements between steps of dimension i + 1, boxes of box[i]
// elements, stored in shared memory in the 128-byte swizzle (box[0] must be 64 elements).
CUtensorMap tile_map(DType t, const void* base, int rank, const uint64_t* dims,
                     const uint64_t* strides, const uint32_t* box) {
  CUtensorMap map{};
  uint64_t stride_bytes[2] = {0, 0};
  for (int i = 0; i + 1 < rank; ++i) stride_bytes[i] = strides[i] * 2;
  const uint32_t ones[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      &map, t == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims, stride_bytes, box, ones,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw InternalError("cuTensorMapEncodeTiled failed (error " + std::to_string(int(r)) +
                        ") for a grouped GEMM operand");
  return map;
}

// The outputs of a rows launch: c, and with SwiGLU also up and h, all [rows, n_total], and the
// rows' routing weights that h is scaled by.
struct RowsOut {
  void* c;
  void* up = nullptr;
  void* h = nullptr;
  const float* row_w = nullptr;
};

// The A operand of a rows launch: `a` itself, [rows, k_total], or with row_token (kGather) its
// rows row_token[r] of a [tokens, k_total].
struct RowsIn {
  const void* a;
  const int32_t* row_token = nullptr;
  int64_t tokens = 0;
  // A pair (grouped_sm90_rows_pair): c = a B(w) + a2 B(w2), a2 shaped as a, w2 as w, one
  // accumulation over both k ranges.
  const void* a2 = nullptr;
};

// A launch configuration in clusters of two blocks (the multicast schedules): `blocks` (even)
// of kTmaThreads with `smem` bytes of dynamic shared memory each, on `stream`.
struct PairLaunch {
  cudaLaunchAttribute cluster{};
  cudaLaunchConfig_t config{};
  PairLaunch(unsigned blocks, size_t smem, cudaStream_t stream) {
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 2;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(kTmaThreads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
  }
  PairLaunch(const PairLaunch&) = delete;  // (config points into it)
  PairLaunch& operator=(const PairLaunch&) = delete;
};

// The cooperative rows kernels' deferred epilogue (deferred_staging) with MOE_GROUPED_DEFER=N,
// N = 1, 2 or 3: warpgroup 0's held stage is freed after the next tile's slice N - 1 is issued
// (tma_math_loop's release_at); 0 (none): off. Read at every launch, as MOE_GROUPED_SM90, so one
// process can time and test every setting. Off by default: measured on an H100 (docs/perf.md, 34th
// session), it trained moe-fine and moe-small no faster.
int deferred_release_at() {
  const char* v = std::getenv("MOE_GROUPED_DEFER");
  const std::string s = v != nullptr ? v : "";
  return s == "1" ? 0 : s == "2" ? 1 : s == "3" ? 2 : -1;
}

// w2: w3 for SwiGLU (kSwiglu), unused otherwise. kSched: the kernel's schedule (pingpong: C =
// PingPong).
// kDefer: the deferred epilogue's kernel (MOE_GROUPED_DEFER takes it where it exists: the
// cooperative kernels but the gathering SwiGLU one, whose math warpgroups spilled 112 bytes),
// release_at its tma_math_loop's (unused by the other kernels).
template <class C, class T, bool kBKFast, bool kSwiglu = false, bool kGather = false,
          Sched kSched = Sched::cooperative, bool kDefer = false>
void launch_rows(Ctx& ctx, DType t, RowsOut out, RowsIn in, const void* w, const void* w2,
                 const int32_t* offsets, int experts, int64_t rows, int64_t n_total,
                 int64_t k_total, int64_t expert_stride, const AdamRider& rider = {},
                 int release_at = 0) {
  if constexpr (kSched == Sched::cooperative && !kDefer && !(kSwiglu && kGather)) {
    const int at = deferred_release_at();
    if (at >= 0 && k_total > 0) {  // (warpgroup 0 stages in its last slice's stage)
      launch_rows<C, T, kBKFast, kSwiglu, kGather, kSched, true>(ctx, t, out, in, w, w2, offsets,
                                                                 experts, rows, n_total, k_total,
                                                                 expert_stride, rider, at);
      return;
    }
  }
  auto kernel = grouped_tma_rows_kernel<C, T, kBKFast, kSwiglu, kGather, kSched, kDefer>;
  constexpr bool kMulticast = is_multicast(kSched);
  // kMulticast: the launch in clusters of two blocks, as many pairs as the device holds at once
  // (one block an SM; a GPC's odd SM holds none).
  static int max_pairs = 0;
  static std::once_flag once;
  std::call_once(once, [&] {
    allow_dynamic_smem(kernel, kRowsSmemBytes<C>);
    if constexpr (kMulticast) {
      const PairLaunch probe(2, kRowsSmemBytes<C>, stream_of(ctx));
      MOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&max_pairs, kernel, &probe.config));
    }
  });
  if constexpr (kMulticast) {
    if (max_pairs < 1) {  // no pair fits: the kernel of the same schedule without pairs
      constexpr Sched kAlone = is_pingpong(kSched) ? Sched::pingpong : Sched::cooperative;
      launch_rows<C, T, kBKFast, kSwiglu, kGather, kAlone>(
          ctx, t, out, in, w, w2, offsets, experts, rows, n_total, k_total, expert_stride, rider);
      return;
    }
  }
  constexpr int kTileN = kSwiglu ? C::kBN / 2 : C::kBN;
  const void* a = in.a;
  // (gathering: a map over the token rows that the kernel does not use)
  const uint64_t a_dims[2] = {uint64_t(k_total), uint64_t(kGather ? in.tokens : rows)};
  const uint64_t a_strides[1] = {uint64_t(k_total)};
  const uint32_t a_box[2] = {kBK, kBM};
  const CUtensorMap map_a = tile_map(t, a, 2, a_dims, a_strides, a_box);
  // w_e as [n_total, k_total] (y = x w_e^T) or [k_total, n_total] (dx = dy w_e), E of them.
  const uint64_t b_dims[3] = {uint64_t(kBKFast ? k_total : n_total),
                              uint64_t(kBKFast ? n_total : k_total), uint64_t(experts)};
  const uint64_t b_strides[2] = {b_dims[0], uint64_t(expert_stride)};
  // (kMulticast: a block loads half of each B slice, load_b; a SwiGLU half is w1's or w3's box)
  const uint32_t b_box[3] = {
      kBK, kBKFast ? uint32_t(kMulticast && !kSwiglu ? kTileN / 2 : kTileN) : 64u, 1};
  const CUtensorMap map_b = tile_map(t, w, 3, b_dims, b_strides, b_box);
  const bool pair = in.a2 != nullptr;
  const CUtensorMap map_b2 = kSwiglu || pair ? tile_map(t, w2, 3, b_dims, b_strides, b_box) : map_b;
  const CUtensorMap map_a2 = pair ? tile_map(t, in.a2, 2, a_dims, a_strides, a_box) : map_a;
  // The outputs [rows, n_total] for the epilogue's TMA stores, boxes of 64 x 64 (store_piece).
  const uint64_t c_dims[2] = {uint64_t(n_total), uint64_t(rows)};
  const uint64_t c_strides[1] = {uint64_t(n_total)};
  const uint32_t c_box[2] = {64, 64};
  const CUtensorMap map_c = tile_map(t, out.c, 2, c_dims, c_strides, c_box);
  const CUtensorMap map_up = kSwiglu ? tile_map(t, out.up, 2, c_dims, c_strides, c_box) : map_c;
  const CUtensorMap map_h = kSwiglu ? tile_map(t, out.h, 2, c_dims, c_strides, c_box) : map_c;
  const int n_tiles = static_cast<int>(blocks_for(n_total, kTileN));
  // (kMulticast: tiles of a pair, 256 rows each)
  const int64_t tiles = int64_t(n_tiles) * (blocks_for(rows, kMulticast ? 2 * kBM : kBM) + experts);
  if constexpr (kMulticast) {
    const PairLaunch pairs(2 * static_cast<unsigned>(std::min<int64_t>(tiles, max_pairs)),
                           kRowsSmemBytes<C>, stream_of(ctx));
    MOE_CUDA_CHECK(cudaLaunchKernelEx(
        &pairs.config, kernel, map_a, map_b, map_b2, map_a2, map_c, map_up, map_h,
        static_cast<T*>(out.c), static_cast<T*>(out.up), static_cast<T*>(out.h), out.row_w, offsets,
        experts, rows, n_total, k_total, n_tiles, tiles, static_cast<const T*>(a), in.row_token,
        in.tokens, rider, pair, release_at));
  } else {
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(tiles, device_sm_count()));
    kernel<<<grid, kTmaThreads, kRowsSmemBytes<C>, stream_of(ctx)>>>(
        map_a, map_b, map_b2, map_a2, map_c, map_up, map_h, static_cast<T*>(out.c),
        static_cast<T*>(out.up), static_cast<T*>(out.h), out.row_w, offsets, experts, rows, n_total,
        k_total, n_tiles, tiles, static_cast<const T*>(a), in.row_token, in.tokens, rider, pair,
        release_at);
  }
  MOE_CUDA_LAUNCH_CHECK();
}

// overwrite: the experts without rows get zeros here (the dw kernel has no units for them).
// Grid row e checks expert e's count; an empty expert's blocks clear dw[e] (a grid-stride loop;
// few experts are empty, and the others' blocks return at once). O: dw's type.
template <class O>
__global__ void zero_empty_experts_kernel(O* dw, const int32_t* offsets, int64_t rows,
                                          int64_t per_expert) {
  const int e = static_cast<int>(blockIdx.y);
  if (clamp_offset(offsets[e + 1], rows) > clamp_offset(offsets[e], rows)) return;
  O* d = dw + int64_t(e) * per_expert;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < per_expert; i += stride)
    d[i] = store<O>(0.0f);
}

// kGatherDy / kGatherX: dy / x is [g.tokens, out / in] and k-row r of the product reads its row
// g.row_token[r]. A pair (dw2 and dy2; dy not gathered): dw2[e] (+)= dy2_e^T x_e in the same
// launch. O: dw's (and dw2's) type, float or __nv_bfloat16 (with_dw_type).
template <class C, class T, bool kGatherDy = false, bool kGatherX = false,
          Sched kSched = Sched::cooperative, class O = float>
void launch_dw(Ctx& ctx, DType t, O* dw, const void* dy, const void* x, const int32_t* offsets,
               int experts, int64_t rows, int64_t out, int64_t in, bool overwrite, DwGather g = {},
               O* dw2 = nullptr, const void* dy2 = nullptr) {
  auto kernel = grouped_tma_dw_kernel<C, T, kGatherDy, kGatherX, kSched, O>;
  static std::once_flag once;
  std::call_once(once, [&] { allow_dynamic_smem(kernel, C::kSmemBytes); });
  const uint32_t box[2] = {64, kBK};
  // (a gathered operand: a map over its token rows that the kernel does not use)
  const uint64_t dy_dims[2] = {uint64_t(out), uint64_t(kGatherDy ? g.tokens : rows)},
                 dy_strides[1] = {uint64_t(out)};
  const uint64_t x_dims[2] = {uint64_t(in), uint64_t(kGatherX ? g.tokens : rows)},
                 x_strides[1] = {uint64_t(in)};
  const CUtensorMap map_dy = tile_map(t, dy, 2, dy_dims, dy_strides, box);
  const CUtensorMap map_x = tile_map(t, x, 2, x_dims, x_strides, box);
  const CUtensorMap map_dy2 =
      dw2 != nullptr ? tile_map(t, dy2, 2, dy_dims, dy_strides, box) : map_dy;
  const int64_t tiles = blocks_for(out, kBM) * blocks_for(in, C::kBN) * (dw2 != nullptr ? 2 : 1);
  // Chunks of twice the mean rows per expert (whole k-slices); no split when the flags run out.
  const int64_t mean = (rows + experts - 1) / experts;
  const int64_t chunk = int64_t(experts) * tiles <= kDwMaxFlags
                            ? std::max<int64_t>(kBK, (2 * mean + kBK - 1) / kBK * kBK)
                            : rows;
  const int64_t most_units = tiles * ((rows + chunk - 1) / chunk + experts);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(most_units, device_sm_count()));
  if (overwrite) {
    const dim3 zgrid(static_cast<unsigned>(std::min<int64_t>(blocks_for(out * in, 256), 64)),
                     static_cast<unsigned>(experts));
    zero_empty_experts_kernel<O><<<zgrid, 256, 0, stream_of(ctx)>>>(dw, offsets, rows, out * in);
    MOE_CUDA_LAUNCH_CHECK();
    if (dw2 != nullptr) {
      zero_empty_experts_kernel<O><<<zgrid, 256, 0, stream_of(ctx)>>>(dw2, offsets, rows, out * in);
      MOE_CUDA_LAUNCH_CHECK();
    }
  }
  kernel<<<grid, kTmaThreads, C::kSmemBytes, stream_of(ctx)>>>(
      map_dy, map_x, map_dy2, dw, dw2, offsets, experts, rows, out, in, chunk, overwrite,
      static_cast<const T*>(dy), static_cast<const T*>(x), g.row_token, g.tokens);
  MOE_CUDA_LAUNCH_CHECK();
}

// Whether the code the device runs for C's kernels is the sm_90a code (see the top comment).
// kS: the kernels of that schedule (multicast: rows kernels only).
template <class C, class T, Sched kS = Sched::cooperative>
bool compiled_for_sm90a() {
#ifdef MOE_WITH_SM90A
  auto is90 = [](int v) { return v >= 90 && v < 100; };
  // (the SwiGLU kernels: 256-column tiles, ping-pong 128)
  using S = std::conditional_t<is_pingpong(kS), PingPong, Wide>;
  if (!is90(compiled_arch(grouped_tma_rows_kernel<S, T, true, true, false, kS>)) ||
      !is90(compiled_arch(grouped_tma_rows_kernel<S, T, true, true, true, kS>)))
    return false;
  if constexpr (!is_multicast(kS)) {
    if (!is90(compiled_arch(grouped_tma_dw_kernel<C, T, false, false, kS>)) ||
        !is90(compiled_arch(grouped_tma_dw_kernel<C, T, true, false, kS>)) ||
        !is90(compiled_arch(grouped_tma_dw_kernel<C, T, false, true, kS>)))
      return false;
  }
  return is90(compiled_arch(grouped_tma_rows_kernel<C, T, true, false, false, kS>)) &&
         is90(compiled_arch(grouped_tma_rows_kernel<C, T, false, false, false, kS>)) &&
         is90(compiled_arch(grouped_tma_rows_kernel<C, T, false, false, true, kS>));
#else
  return false;
#endif
}

bool device_is_sm90() {
  int dev = 0, major = 0, minor = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  return major == 9 && minor == 0;
}

// MOE_GROUPED_SM90 (read at every launch, so the tests cover every setting in one process):
// "0" declines (the sm_80 kernels run), "128" takes 128-column block tiles, "pingpong" the
// ping-pong kernels (pingpong_wait_turn) for the rows and dw products, "pingpong-rows" for the
// rows products only, "multicast" the cluster-pair rows kernels (sched_row_tile; dw as by
// default), "pingpong-multicast" ping-pong rows kernels in cluster pairs and the ping-pong dw
// kernel, anything else (or unset) 256-column cooperative tiles. The fused SwiGLU forward is a
// rows product: ping-pong (64 features a tile) under every ping-pong setting.
enum class Mode { off, narrow, wide, pingpong, pingpong_rows, multicast, pingpong_multicast };
Mode mode() {
  const char* v = std::getenv("MOE_GROUPED_SM90");
  if (v == nullptr) return Mode::wide;
  const std::string s(v);
  return s == "0"                    ? Mode::off
         : s == "128"                ? Mode::narrow
         : s == "pingpong"           ? Mode::pingpong
         : s == "pingpong-rows"      ? Mode::pingpong_rows
         : s == "multicast"          ? Mode::multicast
         : s == "pingpong-multicast" ? Mode::pingpong_multicast
                                     : Mode::wide;
}

// Whether the kernels a launch under setting m takes are the sm_90a code on this device: the
// cooperative ones always, a switch's own schedules only when it asks for them, so that the
// default path never depends on the experimental kernels. Decided once per process and schedule
// for the current device (the trainer uses one device per process).
bool sm90_available(DType t, Mode m) {
  if (t != DType::f16 && t != DType::bf16) return false;
  static std::once_flag once[4];
  static bool ok[4][2] = {};  // [cooperative, pingpong, multicast, pingpong_multicast][f16, bf16]
  auto decided = [&](int i, auto probe) {
    std::call_once(once[i], [&] {
      if (!device_is_sm90()) return;
      ok[i][0] = probe(__half{});
      ok[i][1] = probe(__nv_bfloat16{});
    });
    return ok[i][t == DType::f16 ? 0 : 1];
  };
  auto cooperative = [](auto zero) {
    using T = decltype(zero);
    return compiled_for_sm90a<Wide, T>() && compiled_for_sm90a<Narrow, T>();
  };
  auto pingpong = [](auto zero) {
    return compiled_for_sm90a<PingPong, decltype(zero), Sched::pingpong>();
  };
  auto multicast = [](auto zero) {
    return compiled_for_sm90a<Wide, decltype(zero), Sched::multicast>();
  };
  auto both = [](auto zero) {
    return compiled_for_sm90a<PingPong, decltype(zero), Sched::pingpong_multicast>();
  };
  if (!decided(0, cooperative)) return false;
  switch (m) {
    case Mode::pingpong:
    case Mode::pingpong_rows:
      return decided(1, pingpong);
    case Mode::multicast:
      return decided(2, multicast);
    case Mode::pingpong_multicast:
      return decided(1, pingpong) && decided(3, both);
    default:
      return true;
  }
}

template <Sched kS>
using SchedTag = std::integral_constant<Sched, kS>;

// Calls fn(C{}, T{}, sched) with the configuration, storage type and schedule (a SchedTag) of
// this launch; kDw: a dw product's (no multicast form).
template <bool kDw, class Fn>
void with_config(DType t, Mode m, Fn&& fn) {
  const bool pingpong = m == Mode::pingpong || (m == Mode::pingpong_rows && !kDw) ||
                        (m == Mode::pingpong_multicast && kDw);
  auto typed = [&](auto zero) {
    if (pingpong) {
      fn(PingPong{}, zero, SchedTag<Sched::pingpong>{});
    } else if (m == Mode::pingpong_multicast && !kDw) {
      if constexpr (!kDw) fn(PingPong{}, zero, SchedTag<Sched::pingpong_multicast>{});
    } else if (m == Mode::multicast && !kDw) {
      if constexpr (!kDw) fn(Wide{}, zero, SchedTag<Sched::multicast>{});
    } else if (m == Mode::narrow)
      fn(Narrow{}, zero, SchedTag<Sched::cooperative>{});
    else
      fn(Wide{}, zero, SchedTag<Sched::cooperative>{});
  };
  if (t == DType::f16)
    typed(__half{});
  else
    typed(__nv_bfloat16{});
}

}  // namespace

bool grouped_sm90_rows(Ctx& ctx, DType t, void* c, const void* a, const void* w,
                       const int32_t* offsets, int experts, int64_t rows, int64_t n_total,
                       int64_t k_total, int64_t expert_stride, bool b_k_fast,
                       const int32_t* row_token, int64_t tokens, const AdamRider* rider) {
  const Mode m = mode();
  // (gathering: the dx = dy w[e] form only, the one the trainer gathers; a rider: not with it,
  // the producer warpgroup's threads all copy there)
  if (m == Mode::off || !sm90_available(t, m) || (row_token != nullptr && b_k_fast) ||
      (rider != nullptr && row_token != nullptr) ||
      !rows_operands_fit(c, a, w, n_total, k_total, expert_stride, b_k_fast, rows, experts, kBM))
    return false;
  if (rows == 0) return true;  // nothing to write (and a tensor map needs a row)
  const RowsIn in{a, row_token, tokens};
  with_config<false>(t, m, [&](auto cfg, auto zero, auto sched) {
    using C = decltype(cfg);
    using T = decltype(zero);
    constexpr Sched kS = decltype(sched)::value;
    const AdamRider r = rider ? *rider : AdamRider{};
    if (row_token != nullptr)
      launch_rows<C, T, false, false, true, kS>(ctx, t, {c}, in, w, nullptr, offsets, experts, rows,
                                                n_total, k_total, expert_stride);
    else if (b_k_fast)
      launch_rows<C, T, true, false, false, kS>(ctx, t, {c}, in, w, nullptr, offsets, experts, rows,
                                                n_total, k_total, expert_stride, r);
    else
      launch_rows<C, T, false, false, false, kS>(ctx, t, {c}, in, w, nullptr, offsets, experts,
                                                 rows, n_total, k_total, expert_stride, r);
  });
  return true;
}

// The dw kernel's operand conditions: dy's and x's rows 16-byte aligned, out and in multiples of
// 8, dw 8-byte aligned (float2 adds; bf16: dw_store_bf16_pairs' 4 columns), the experts' unit table
// in shared memory; a bf16 dw beside bf16 inputs only (linear.hpp).
static bool dw_operands_fit(DType t, const void* dw, DType dw_t, const void* dy, const void* x,
                            int64_t out, int64_t in, int experts) {
  const bool bf16_dw = dw_t == DType::bf16;
  if (bf16_dw ? t != DType::bf16 : dw_t != DType::f32) return false;
  return aligned16_rows(dy, out) && aligned16_rows(x, in) && out % 8 == 0 && in % 8 == 0 &&
         reinterpret_cast<uintptr_t>(dw) % 8 == 0 && experts <= kSharedOffsets;
}

// Calls fn(O{}) with O the dw kernel's output type: __nv_bfloat16 for a bf16 dw beside T =
// __nv_bfloat16 (dw_operands_fit's condition), else float. (No f16 x bf16 kernels are built.)
template <class T, class Fn>
void with_dw_type(DType dw_t, Fn&& fn) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (dw_t == DType::bf16) return fn(__nv_bfloat16{});
  }
  fn(float{});
}

bool grouped_sm90_dw_pair(Ctx& ctx, DType t, void* dw, void* dw2, DType dw_t, const void* dy,
                          const void* dy2, const void* x, const int32_t* offsets, int experts,
                          int64_t rows, int64_t out, int64_t in, bool overwrite, DwGather g) {
  const Mode m = mode();
  // grouped_sm90_dw's operand conditions for each gradient; dy not gathered (the pair switches
  // its tensor map); no rows or experts: the caller's two calls
  if (m == Mode::off || !sm90_available(t, m) || g.dy ||
      !dw_operands_fit(t, dw, dw_t, dy, x, out, in, experts) ||
      !dw_operands_fit(t, dw2, dw_t, dy2, x, out, in, experts) || rows == 0 || experts == 0)
    return false;
  with_config<true>(t, m, [&](auto cfg, auto zero, auto sched) {
    using C = decltype(cfg);
    using T = decltype(zero);
    constexpr Sched kS = decltype(sched)::value;
    with_dw_type<T>(dw_t, [&](auto out_zero) {
      using O = decltype(out_zero);
      if (g.x)
        launch_dw<C, T, false, true, kS>(ctx, t, static_cast<O*>(dw), dy, x, offsets, experts, rows,
                                         out, in, overwrite, g, static_cast<O*>(dw2), dy2);
      else
        launch_dw<C, T, false, false, kS>(ctx, t, static_cast<O*>(dw), dy, x, offsets, experts,
                                          rows, out, in, overwrite, {}, static_cast<O*>(dw2), dy2);
    });
  });
  return true;
}

bool grouped_sm90_rows_pair_runs(DType t, int64_t rows, int experts, int64_t n_total,
                                 int64_t k_total) {
  const Mode m = mode();
  return m != Mode::off && sm90_available(t, m) &&
         rows_sizes_fit(n_total, k_total, rows, experts, kBM);
}

bool grouped_sm90_rows_pair(Ctx& ctx, DType t, void* c, const void* a, const void* a2,
                            const void* w, const void* w2, const int32_t* offsets, int experts,
                            int64_t rows, int64_t n_total, int64_t k_total, int64_t expert_stride) {
  const Mode m = mode();
  if (m == Mode::off || !sm90_available(t, m) ||
      !rows_operands_fit(c, a, w, n_total, k_total, expert_stride, false, rows, experts, kBM) ||
      !rows_operands_fit(c, a2, w2, n_total, k_total, expert_stride, false, rows, experts, kBM))
    return false;
  if (rows == 0) return true;  // nothing to write
  RowsIn in{a};
  in.a2 = a2;
  with_config<false>(t, m, [&](auto cfg, auto zero, auto sched) {
    using C = decltype(cfg);
    using T = decltype(zero);
    launch_rows<C, T, false, false, false, decltype(sched)::value>(
        ctx, t, {c}, in, w, w2, offsets, experts, rows, n_total, k_total, expert_stride);
  });
  return true;
}

bool grouped_sm90_swiglu(Ctx& ctx, DType t, void* gate, void* up, void* h, const void* x,
                         const void* w1, const void* w3, const float* row_w, const int32_t* offsets,
                         int experts, int64_t rows, int64_t features, int64_t in,
                         const int32_t* row_token, int64_t tokens) {
  const Mode m = mode();
  const int64_t stride = features * in;
  // MOE_SWIGLU_FUSED=0 (read at every call) declines: the bench and tests compare both paths.
  if (!env_switch("MOE_SWIGLU_FUSED", true) || row_w == nullptr || m == Mode::off ||
      m == Mode::narrow || !sm90_available(t, m) ||
      !rows_operands_fit(gate, x, w1, features, in, stride, true, rows, experts, kBM) ||
      !rows_operands_fit(up, x, w3, features, in, stride, true, rows, experts, kBM) ||
      !aligned16_rows(h, features))
    return false;
  if (rows == 0) return true;  // nothing to write
  const RowsOut out{gate, up, h, row_w};
  const RowsIn a{x, row_token, tokens};
  // (a tile of 128 features, gate and up 256 columns; ping-pong: 64 features, 128 columns:
  // with_config's configuration for each schedule, the narrow one declined above)
  with_config<false>(t, m, [&](auto cfg, auto zero, auto sched) {
    using C = decltype(cfg);
    using T = decltype(zero);
    constexpr Sched kS = decltype(sched)::value;
    if constexpr (!std::is_same_v<C, Narrow>) {  // (narrow: declined above)
      if (row_token != nullptr)
        launch_rows<C, T, true, true, true, kS>(ctx, t, out, a, w1, w3, offsets, experts, rows,
                                                features, in, stride);
      else
        launch_rows<C, T, true, true, false, kS>(ctx, t, out, a, w1, w3, offsets, experts, rows,
                                                 features, in, stride);
    }
  });
  return true;
}

bool grouped_sm90_dw(Ctx& ctx, DType t, void* dw, DType dw_t, const void* dy, const void* x,
                     const int32_t* offsets, int experts, int64_t rows, int64_t out, int64_t in,
                     bool overwrite, DwGather g) {
  const Mode m = mode();
  // More experts than the unit table holds (kSharedOffsets): the sm_80 kernels. Both operands
  // gathered (no caller: the producer threads spilled there) declines too.
  if (m == Mode::off || !sm90_available(t, m) || (g.dy && g.x) ||
      !dw_operands_fit(t, dw, dw_t, dy, x, out, in, experts))
    return false;
  if (rows == 0 || experts == 0) {  // every dw[e] += 0 (or = 0: zero bits in f32 and bf16)
    if (overwrite)
      MOE_CUDA_CHECK(
          cudaMemsetAsync(dw, 0, size_t(experts) * out * in * dtype_size(dw_t), stream_of(ctx)));
    return true;
  }
  with_config<true>(t, m, [&](auto cfg, auto zero, auto sched) {
    using C = decltype(cfg);
    using T = decltype(zero);
    constexpr Sched kS = decltype(sched)::value;
    with_dw_type<T>(dw_t, [&](auto out_zero) {
      using O = decltype(out_zero);
      O* const d = static_cast<O*>(dw);
      if (g.dy)
        launch_dw<C, T, true, false, kS>(ctx, t, d, dy, x, offsets, experts, rows, out, in,
                                         overwrite, g);
      else if (g.x)
        launch_dw<C, T, false, true, kS>(ctx, t, d, dy, x, offsets, experts, rows, out, in,
                                         overwrite, g);
      else
        launch_dw<C, T, false, false, kS>(ctx, t, d, dy, x, offsets, experts, rows, out, in,
                                          overwrite);
    });
  });
  return true;
}

}  // namespace moe::cuda_detail
