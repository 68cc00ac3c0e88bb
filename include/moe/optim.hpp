// The optimizer side of a step: AdamW state over the contiguous parameter buffer, the learning
// rate schedule and global-norm gradient clipping.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "moe/config.hpp"
#include "moe/memory.hpp"
#include "moe/model.hpp"
#include "moe/ops/optim.hpp"

namespace moe {

// lr at optimizer step `step` (0-based): linear warmup from warmup_min_ratio * lr to lr over
// warmup_num_steps, then constant (WarmupLR) or cosine down to cos_min_ratio * lr at
// total_num_steps (WarmupCosineLR; 0 = max_steps), constant after.
double learning_rate(const SchedulerConfig& s, double base_lr, int step, int max_steps);

// Which elements of the flat parameter buffer (P elements) a data-parallel rank updates.
// ZeRO stages 1 and 2 split the first world * chunk elements (chunk = floor(P / world)) into
// `world` equal, contiguous chunks: rank r owns [r * chunk, (r + 1) * chunk). The tail
// [world * chunk, P) (fewer than `world` elements) is owned by every rank: each updates it
// identically from the same all-reduced gradient. So every collective works in place on the
// model's own buffers (all_gather / reduce_scatter need world equal chunks) without padding.
// Stage 0 (and world 1): one rank owns everything.
//
// ZeRO stage 3 (per_unit) shards the parameters themselves, so the split must line up with what
// is gathered at once: the model's units (embedding, each layer, final norm + head; see
// param_unit_bounds). Unit u of S_u elements is cut into `world` chunks of ceil(S_u / world)
// (the last ones shorter or empty); rank r owns chunk r of every unit, stored at a fixed padded
// slot of ceil(S_u / world) elements in its local buffers, so one all_gather (equal chunks)
// rebuilds a unit and one reduce_scatter gives each rank its chunk of a unit's gradient. There
// the model's own params() / grads() hold only the local elements (local_buffers).
struct ZeroPartition {
  size_t total = 0;       // P
  size_t chunk = 0;       // elements per rank in the split part (the whole buffer when unsharded)
  size_t begin = 0;       // this rank's chunk: [begin, begin + chunk)
  size_t tail_begin = 0;  // [tail_begin, total): updated by every rank (empty when unsharded)
  int rank = 0, world = 1;
  bool sharded = false;
  // per_unit only: the model's params() / grads() are this rank's local elements (Range::local)
  // rather than the whole buffer (Range::global).
  bool local_buffers = false;

  static ZeroPartition whole(size_t total);
  static ZeroPartition split(size_t total, int rank, int world);
  // bounds: unit starts, then P (bounds.front() == 0).
  static ZeroPartition per_unit(const std::vector<size_t>& bounds, int rank, int world);
  size_t split_end() const { return sharded ? chunk * static_cast<size_t>(world) : total; }
  size_t tail() const { return total - tail_begin; }
  // Elements of optimizer state this rank keeps: its chunk, then the tail (per_unit: every
  // unit's padded chunk).
  size_t local() const { return local_buffers ? local_elems_ : chunk + tail(); }
  // Elements this rank owns (local() without per_unit's padding).
  size_t owned() const;
  // The global ranges this rank owns, with their offset in the local state.
  struct Range {
    size_t global, count, local;
  };
  std::vector<Range> ranges() const;
  // Where a range's elements sit in the model's params() / grads().
  size_t model_offset(const Range& r) const { return local_buffers ? r.local : r.global; }

 private:
  std::vector<Range> unit_ranges_;  // per_unit: one per unit with elements here
  size_t local_elems_ = 0;          // per_unit: the sum of the padded chunks
};

// Elements per rank of unit [begin, end) under ZeroPartition::per_unit.
inline size_t unit_chunk(size_t begin, size_t end, int world) {
  return (end - begin + static_cast<size_t>(world) - 1) / static_cast<size_t>(world);
}

// Queues acc[0] = sum of squared gradients over the whole gradient buffer; `acc` is a 1-element
// f64 tensor on the model's device (kept by the caller, so a step allocates nothing). Nothing is
// read back: AdamW::step clips from it on the device.
void queue_grad_norm_sq(Ctx& ctx, const Model& model, Tensor acc);
// Queues acc[0] = sum of squared gradients over the given global ranges of the gradient buffer
// (ZeRO-2: this rank's reduced shard; the caller then sums acc over the ranks).
void queue_grad_norm_sq_ranges(Ctx& ctx, const Model& model, Tensor acc,
                               const std::vector<ZeroPartition::Range>& ranges);
// sqrt(sum of squared gradients), read back (waits for the device).
double global_grad_norm(Ctx& ctx, const Model& model, Tensor acc);
// The factor that brings `norm` down to `max_norm` (1 when clipping is off or not needed).
double clip_factor(double norm, double max_norm);

// Optimizer offload (zero_optimization.offload_optimizer): the state lives in host memory and a
// CPU AdamW updates it.
struct OffloadOptions {
  bool enabled = false;
  bool pin_memory = false;  // page-locked host buffers; only with a GPU model (else ignored)
  // ZeRO-3 parameter offload: the model's params() and grads() are this rank's chunks in host
  // memory already; the CPU AdamW updates them where they lie (no master copy, no staging).
  bool in_place = false;
  // Overlap the CPU AdamW with the backward (not in place): the caller starts the step before
  // the last backward (begin_overlapped_step) and reports each range of gradients that reaches
  // the host staging (landing_hook). A thread updates those ranges at once, guessing that the
  // step is neither clipped nor skipped, into a second copy of the master and moments (12 bytes
  // per owned element more host memory). Once step() knows the norm: a guess that held is kept;
  // on a clip the thread goes on with the real scale and makes the ranges it updated with the
  // guess again from the first copy (so a wrong guess costs what the update after the backward
  // would); a skip drops it all. So the result is bitwise that of the update after the backward.
  bool overlap = false;
};

class AdamW {
 public:
  // State (m, v) for the elements `part` gives this rank (default: the whole buffer).
  // With offload, m and v, an fp32 master copy of this rank's elements and a staging buffer for
  // their gradients live in host memory (`pinned` when asked and the model is on a GPU), separate
  // from the model's buffers also on a CPU model, so the CPU runs the same code path as a GPU.
  AdamW(const OptimizerConfig& cfg, const Model& model);
  AdamW(const OptimizerConfig& cfg, const Model& model, const ZeroPartition& part,
        OffloadOptions offload = {});
  // One update with learning rate `lr` of the elements this rank owns (the rest of the
  // parameter buffer is left alone: ZeRO gathers it from the other ranks afterwards); gradients are
  // multiplied by grad_scale first. With `norm_sq` (from queue_grad_norm_sq) the device computes
  // the norm of the scaled gradients, clips it to max_norm (0 = off) and skips the update when it
  // is not finite (fp16 overflow), so the host reads nothing. A skipped step must be reported with
  // undo_step().
  // Offloaded: the owned gradient ranges are copied to the host (after the caller's reduction),
  // norm_sq is read there (so the step waits for the device), the CPU AdamW updates the host
  // master and moments with the same math and the same skip and clip decisions, and the updated
  // master ranges are copied into params() (queued on ctx's stream when pinned). The caller then
  // gathers and calls Model::weights_changed as after any step.
  // `norm_out` (on the device, unsharded and not offloaded, without norm_sq): a 1-element f64
  // tensor that ends holding the sum of squared gradients (as queue_grad_norm_sq's norm_sq would),
  // taken by the update from its own read of the gradients (AdamWArgs::grad_sq_out): the norm
  // for the log when nothing is clipped or skipped, without a pass of its own. Overlapped, it is
  // written on the side stream: read it after join().
  void step(Ctx& ctx, Model& model, double lr, double grad_scale, Tensor norm_sq = Tensor(),
            double max_norm = 0, Tensor norm_out = Tensor());
  // Offloaded (not in place): the host staging of this rank's gradients (partition().local()
  // elements of the master dtype), else nullptr. After gradients_on_host() the next step() takes
  // the gradients from there as they are (someone copied them in, e.g. during the backward)
  // instead of copying them from the model.
  void* host_gradients() const;
  void gradients_on_host() { grads_on_host_ = true; }
  // OffloadOptions::overlap: starts the next step's update with learning rate `lr` and gradient
  // scale `grad_scale` (those step() will get), before the last micro-batch's backward; the
  // master copy is taken from params() first if it is not current. landing_hook() is what the
  // gradient buckets call, from any thread, once the owned part of [begin, end) (global
  // offsets) is in host_gradients(); every owned element must land once before step().
  bool overlaps_backward() const { return offload_.overlap; }
  // Whether to overlap the next step: not right after a clipped or skipped step, since whether a
  // step is clipped changes slowly and a wrong guess costs more than no guess (the ranges
  // updated with it are made again, and the second copy is written more slowly than in place).
  bool worth_overlapping() const { return offload_.overlap && !guess_failed_; }
  void begin_overlapped_step(const Model& model, double lr, double grad_scale);
  std::function<void(size_t begin, size_t end)> landing_hook() const;
  // Blocks until the thread has updated every range landed so far (for tests: a guess that is
  // wholly made before the step decides).
  void wait_overlapped_idle() const;
  // In place (ZeRO-3 parameter offload), step() returns once the update is decided and leaves the
  // CPU AdamW running in a thread, range by range in local order, behind the next forward:
  // wait_local(end) blocks until every owned range starting below local offset `end` is updated
  // (the model waits so before it gathers a unit: Model::set_chunk_wait), finish() until all
  // is. The moments' accessors and the next step finish first; so does the destructor.
  void wait_local(size_t end) const;
  void finish() const;
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;
  // The last step() was skipped on the device: its bias-correction count is taken back.
  void undo_step() { --step_; }
  long steps_taken() const { return step_; }
  const ZeroPartition& partition() const { return part_; }
  bool offloaded() const { return offload_.enabled; }
  // The whole update runs here on the model's device: not offloaded, not split over ranks (what
  // the overlap with the forward and the norm from the update need).
  bool updates_whole_on_device() const { return !offload_.enabled && !part_.sharded; }
  // step() writes model's compute copy itself (unsharded, not offloaded, mixed precision: see
  // AdamWArgs::compute_out), so the caller then calls model.weights_changed(ctx, true).
  bool writes_compute_copy(const Model& m) const {
    return !offload_.enabled && !part_.sharded && !m.compute_params().empty();
  }
  // The moments of the owned elements, laid out as partition().ranges() say (unsharded: like the
  // parameter buffer); host tensors when offloaded.
  Tensor moment1() const;
  Tensor moment2() const;
  void set_steps_taken(long s) { step_ = s; }
  struct Item;  // one host update of a run of elements (defined in adamw.cpp)
  // Overlap with the next forward (train.overlap_optimizer; a CUDA model, unsharded, not
  // offloaded). step() then returns with the update queued on the device's side stream
  // (gpu::side_stream) behind ctx's work so far (the gradient norm), unit by unit in
  // param_unit_bounds order (the embedding, each layer, the final norm and head): each unit's
  // AdamW and its refreshed compute copies (Model::weights_changed over the unit), then the next
  // step's zeroing of the gradients (Model::zero_grads(ctx, true): after every read of this
  // step's; the trainer skips its own). The forward calls wait_unit before it uses each unit
  // (Model::set_unit_wait): ctx's stream waits for that unit's update; the last unit's wait also
  // covers the zeroing. join() makes ctx's stream wait for all of it. The same bits as the
  // update in line.
  void overlap_forward(const Model& model);
  bool overlaps_forward() const { return overlap_ != nullptr; }
  void wait_unit(Ctx& ctx, int unit);
  void join(Ctx& ctx);
  // params() was written from outside (initialisation, a checkpoint load): an offloaded
  // optimizer takes its master copy from there again before its next step. (A fresh optimizer
  // does so before its first step.)
  void params_written() { master_current_ = false; }

 private:
  // A run of adjacent parameters sharing one weight-decay choice: one fused update each.
  struct Segment {
    size_t offset, numel;
    bool decay;
  };
  void step_offloaded(Ctx& ctx, Model& model, double lr, double grad_scale, Tensor norm_sq,
                      double max_norm);
  void step_overlapped(Ctx& ctx, Model& model, double lr, double grad_scale, Tensor norm_sq,
                       double max_norm, Tensor norm_out);
  // Queues the on-device update of the owned elements within global [begin, end) on ctx's
  // stream (every owned range x decay segment intersection: one fused op each).
  void queue_update(Ctx& ctx, Model& model, double lr, double grad_scale, Tensor norm_sq,
                    double max_norm, Tensor norm_out, size_t begin, size_t end);
  // The host update's arguments for step number `step` (weight decay set per segment).
  AdamWArgs host_args(double lr, long step, double grad_scale) const;
  // The updates of the owned elements within global [begin, end): one per (owned range x
  // weight-decay segment) intersection, at byte offsets of the local host state.
  std::vector<Item> items_within(size_t begin, size_t end, AdamWArgs a, double scale) const;
  void take_master(const Model& model);  // params() -> the host master (offloaded)
  // The overlapped update learns the step's fate: skipped (drop it), or its real gradient scale.
  void decide_overlapped(bool skipped, double scale);
  void finish_overlapped();  // waits for the overlapped update's thread
  // A host buffer of the owned elements, as a flat tensor.
  Tensor local(const Buffer& b) const;

  OptimizerConfig cfg_;
  ZeroPartition part_;
  std::vector<Segment> segments_;
  Buffer m_, v_;
  DType dtype_;
  long step_ = 0;
  OffloadOptions offload_;
  Buffer master_, grads_;  // offloaded: host copies of the owned weights and their gradients
  bool master_current_ = false;
  bool grads_on_host_ = false;
  bool guess_failed_ = false;  // the last offloaded step was clipped or skipped
  struct Background;
  std::unique_ptr<Background> background_;
  // OffloadOptions::overlap: the second copy the guessed update writes, and its thread (shared
  // with the landing hooks, which may run on a driver thread after this object is gone).
  Buffer next_master_, next_m_, next_v_;
  struct Speculation;
  std::shared_ptr<Speculation> spec_;
  struct Overlap;  // overlap_forward (adamw_overlap.cpp)
  std::unique_ptr<Overlap> overlap_;
};

}  // namespace moe
