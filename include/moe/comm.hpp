// Communication between ranks: who we are (RankInfo, read from the launcher's environment) and the
// collectives the trainer needs (Comm), with three implementations behind one interface:
//   SingleComm  world 1, any device: reductions are no-ops, gathers copy;
//   MpiComm     CPU tensors over MPI (the CPU ranks of `mpirun -np 4` in CI);
//   NcclComm    GPU tensors over NCCL (CUDA builds); MPI carries only the NCCL unique id.
// make_comm() picks one. Implementations live in src/parallel/.
//
// Ordering. MpiComm and SingleComm on CPU tensors: a call returns when its result is in place.
// NcclComm (and SingleComm on GPU tensors): a call enqueues the work on the stream given to
// set_stream() (default: the device's default stream, gpu::default_stream) and returns at once;
// the result is ready for later work on that stream, and for the host after the stream is
// synchronized. barrier() is the exception: it returns on the host after every rank reached it.
//
// Failure. Every collective is watched: if it does not complete within the timeout (a peer died
// or hangs) the rank prints one line
//   moe-train: rank R: <op> did not complete within N s (a peer rank died or hangs); aborting
// to stderr and aborts the whole job (MPI_Abort; NCCL: ncclCommAbort first). A failing MPI or NCCL
// call throws CommError naming the operation. timeout_s = 0 turns the watchdog off.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "moe/tensor.hpp"

namespace moe {

// Where this process sits among the ranks of one job.
struct RankInfo {
  int rank = 0;         // 0 .. world-1
  int world = 1;        // number of ranks in the job
  int local_rank = 0;   // 0 .. local_world-1: the rank among those on this node (picks the GPU)
  int local_world = 1;  // ranks on this node
  std::string launcher = "single";  // "mpirun (Open MPI)", "PMI (MPICH/Hydra)", "srun", "single"
};

// Reads the rank layout from the environment, first match wins:
//   OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE      Open MPI's mpirun (all four required)
//   PMI_RANK/PMI_SIZE (+ MPI_LOCALRANKID/MPI_LOCALNRANKS) MPICH, Intel MPI, srun --mpi=pmi2;
//                                                        without the local pair: SLURM_LOCALID if
//                                                        set, else one node (local = global)
//   SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID               srun (only when SLURM_NTASKS is set);
//                                                        local_world from SLURM_STEP_TASKS_PER_NODE
//                                                        (or SLURM_TASKS_PER_NODE) at SLURM_NODEID
//   none of these                                         a single process: rank 0 of 1
// `getenv` looks a name up (nullptr when unset), so tests can pass a fake environment.
// Throws InputError when a value is not an integer or the values contradict each other.
using EnvLookup = std::function<const char*(const char* name)>;
RankInfo detect_ranks(const EnvLookup& getenv);
RankInfo detect_ranks();  // the process environment

// The GPU a rank uses: its local rank, or 0 when the launcher gave each rank one visible GPU.
// Throws InputError when the node has more ranks than visible GPUs.
int pick_local_gpu(const RankInfo& info, int visible_gpus);

// A failed MPI / NCCL call, or a launch that cannot form the job (exit code 1 at main).
struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Seconds a collective may take before the watchdog aborts the job (make_comm's default).
constexpr double kDefaultCommTimeoutS = 600.0;

// The collectives. All ranks call the same collectives in the same order with matching sizes
// and dtypes (as in MPI and NCCL). Reductions sum. Tensors are row-major and contiguous; every
// tensor of one call has the same dtype and lives on device(). dtypes: f32, f64, i32 everywhere;
// f16 and bf16 on NcclComm, and on MpiComm for the collectives that only move data (all_gather,
// all_to_all_v, broadcast). Size mismatches, wrong devices or dtypes throw InternalError.
class Comm {
 public:
  virtual ~Comm() = default;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return info_.rank; }
  int world() const { return info_.world; }
  int local_rank() const { return info_.local_rank; }
  const RankInfo& info() const { return info_; }
  // Where this comm's tensors live (NcclComm: the GPU picked by pick_local_gpu).
  Device device() const { return device_; }
  double timeout_s() const { return timeout_s_; }
  virtual const char* backend() const = 0;  // "single", "mpi", "nccl"

  // inout = sum over ranks of inout; identical bits on every rank.
  virtual void all_reduce_sum(Tensor inout) = 0;
  // On rank `root`: inout = sum over ranks of inout. On the other ranks inout is left
  // unspecified (it may hold partial sums). ZeRO-2 buckets: each part of a bucket goes to the
  // rank that owns it, half the volume of an all-reduce.
  virtual void reduce_sum(Tensor inout, int root) = 0;
  // in: [world * n] elements, out: [n]; out = chunk `rank` of (sum over ranks of in).
  // In place when out is chunk `rank` of in (the rest of in is then unspecified).
  virtual void reduce_scatter_sum(Tensor out, Tensor in) = 0;
  // in: [n], out: [world * n]; chunk r of out = in of rank r.
  // In place when in is chunk `rank` of out.
  virtual void all_gather(Tensor out, Tensor in) = 0;
  // Personalised exchange in rows of dim 0 (a row = the elements of dims 1..; in and out rows
  // have the same size). in_counts[p] rows go to peer p, taken in peer order from in;
  // out_counts[p] rows come from peer p, stored in peer order in out. Counts may be zero;
  // out_counts[p] on this rank equals in_counts[rank] on peer p. out and in must not overlap.
  virtual void all_to_all_v(Tensor out, const std::vector<int64_t>& out_counts, Tensor in,
                            const std::vector<int64_t>& in_counts) = 0;
  // t = t of rank `root`, on every rank.
  virtual void broadcast(Tensor t, int root) = 0;
  // dst (on device()) = dst.nbytes() bytes of host memory at src, queued where the collectives
  // go (so a collective after it sees the data): ZeRO-3's parameter offload stages a weight
  // chunk this way before gathering it. Not a collective: each rank copies its own. src should
  // be page-locked for the copy to be asynchronous on a GPU.
  virtual void copy_from_host(Tensor dst, const void* src) = 0;
  // The other way: src.nbytes() bytes of src (on device()) to host memory at dst, queued the
  // same way (the reduced gradient chunks of the parameter offload); dst should be page-locked.
  virtual void copy_to_host(void* dst, Tensor src) = 0;
  // fn() runs once the work queued where the collectives go (so far) is done: CPU comms call it
  // at once, on this thread (their work is done when the call returns); on a GPU it runs on a
  // driver thread (gpu::launch_host_func), so it must only hand off (e.g. notify a waiting
  // thread) and call no CUDA. The optimizer offload learns this way that a bucket's gradients
  // have reached the host while the backward goes on.
  virtual void after_queued(std::function<void()> fn) = 0;
  // Returns (on the host) once every rank has called it; NCCL: after this rank's enqueued
  // collectives completed.
  virtual void barrier() = 0;
  // NCCL / GPU tensors: the cudaStream_t the collectives are enqueued on (nullptr = the device's
  // default stream). Ignored by CPU comms.
  virtual void set_stream(void* stream) = 0;
  // Overlap with compute (NcclComm): the collectives after this call run on the comm's own
  // stream, once the work queued on the set_stream() stream so far is done, while later work on
  // that stream goes on. Call it again before each collective that must also wait for work
  // queued since. CPU comms (whose collectives complete before they return) and SingleComm: no
  // effect.
  virtual void fork_from_compute() {}
  // The set_stream() stream waits for every collective queued since fork_from_compute(); later
  // collectives run on it again.
  virtual void join_compute() {}

 protected:
  Comm(RankInfo info, Device device, double timeout_s)
      : info_(std::move(info)), device_(device), timeout_s_(timeout_s) {}

 private:
  RankInfo info_;
  Device device_;
  double timeout_s_;
};

// world 1 -> SingleComm on `dev`; world > 1 -> NcclComm when dev is a GPU (device picked by
// pick_local_gpu; dev.index is ignored), else MpiComm. The first multi-rank comm initialises MPI
// (MPI_Init_thread) and finalises it at exit. Throws CommError when the build lacks MPI / NCCL or
// MPI's view of the job differs from `info` (e.g. srun without --mpi=pmix).
std::unique_ptr<Comm> make_comm(const RankInfo& info, Device dev,
                                double timeout_s = kDefaultCommTimeoutS);

// Every rank's `mine` (the same count on every rank), rank after rank, on every rank: a
// collective for small host values (src/parallel/host_ints.cpp).
std::vector<int32_t> all_gather_ints(Comm& comm, const std::vector<int32_t>& mine);

}  // namespace moe
