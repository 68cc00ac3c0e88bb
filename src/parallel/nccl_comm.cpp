// NcclComm: the collectives on GPU tensors over NCCL. MPI starts the job: rank 0 creates the
// NCCL unique id and an MpiComm broadcasts it; the local rank picks the GPU (pick_local_gpu).
//
// Collectives are enqueued on the comm's stream (set_stream's, or between fork_from_compute and
// join_compute a side stream of its own, so they overlap later compute) and return at once. The
// watchdog watches them in two ways: host calls that can block (communicator setup, the first use
// of a connection, barrier) are armed like MpiComm's; for the GPU side, each collective sits
// between two events and must complete within the timeout of the stream reaching it
// (QueuedDeadlines: time spent queued behind a long forward and backward does not count), and
// ncclCommGetAsyncError is polled about every 100 ms. On failure it prints one line, calls
// ncclCommAbort (frees the GPU from the stuck kernels) and then ends the job (mpi_abort_job).
#if defined(MOE_WITH_NCCL) && defined(MOE_WITH_MPI)
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "parallel/comm_impl.hpp"
#include "parallel/mpi_runtime.hpp"
#include "parallel/queued_deadlines.hpp"
#include "parallel/watchdog.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/error.hpp"

namespace moe::dist {

namespace {

// NCCL's last-error text (2.13+) and communicator finalisation (2.14+), where the library has them.
const char* nccl_last_error(ncclComm_t comm) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  return ncclGetLastError(comm);
#else
  (void)comm;
  return "";
#endif
}

ncclResult_t nccl_finalize(ncclComm_t comm) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
  return ncclCommFinalize(comm);
#else
  (void)comm;
  return ncclSuccess;  // ncclCommDestroy waits for the pending work itself
#endif
}

[[noreturn]] void throw_nccl(ncclResult_t r, ncclComm_t comm, const char* call, const char* op,
                             int rank, const char* file, int line) {
  mpi_mark_failed();
  const char* last = nccl_last_error(comm);
  throw CommError("NCCL error in " + std::string(op) + " (" + call + ") on rank " +
                  std::to_string(rank) + " at " + file + ":" + std::to_string(line) + ": " +
                  ncclGetErrorString(r) + (last && *last ? std::string(": ") + last : ""));
}

[[noreturn]] void throw_cuda(cudaError_t e, const char* call, const char* op, int rank,
                             const char* file, int line) {
  mpi_mark_failed();
  throw CommError("CUDA error in " + std::string(op) + " (" + call + ") on rank " +
                  std::to_string(rank) + " at " + file + ":" + std::to_string(line) + ": " +
                  cudaGetErrorString(e));
}

#define MOE_NCCL_CHECK(call, op)                                             \
  do {                                                                       \
    ncclResult_t r_ = (call);                                                \
    if (r_ != ncclSuccess && r_ != ncclInProgress)                           \
      throw_nccl(r_, comm_.load(), #call, (op), rank(), __FILE__, __LINE__); \
  } while (0)

#define MOE_COMM_CUDA_CHECK(call, op)                                               \
  do {                                                                              \
    cudaError_t e_ = (call);                                                        \
    if (e_ != cudaSuccess) throw_cuda(e_, #call, (op), rank(), __FILE__, __LINE__); \
  } while (0)

bool nccl_accepts(DType, DTypeUse) {
  return true;
}  // f32, f64, f16, bf16, i32

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::f16:
      return ncclFloat16;
    case DType::bf16:
      return ncclBfloat16;
    case DType::i32:
      return ncclInt32;
    case DType::u16:
      break;  // never sent: the split master's low halves stay on their rank
  }
  throw InternalError("nccl_type: unknown dtype");
}

char* bytes(const Tensor& t) {
  return static_cast<char*>(t.data);
}

class NcclComm final : public Comm {
 public:
  NcclComm(const RankInfo& info, int gpu, double timeout_s, std::unique_ptr<Comm> bootstrap)
      : Comm(info, Device{DeviceType::cuda, gpu}, timeout_s), bootstrap_(std::move(bootstrap)) {
    gpu::set_device(gpu);
    stream_ = static_cast<cudaStream_t>(gpu::default_stream(gpu));
    compute_stream_ = stream_;
    watchdog_ = std::make_unique<Watchdog>(
        info.rank, timeout_s,
        [this] {
          if (ncclComm_t c = comm_.load()) ncclCommAbort(c);
          mpi_abort_job(kCommAbortExitCode);
        },
        [this] { return poll(); });

    static_assert(sizeof(ncclUniqueId) % sizeof(int32_t) == 0, "unique id in 32-bit words");
    ncclUniqueId id{};
    if (info.rank == 0) MOE_NCCL_CHECK(ncclGetUniqueId(&id), "comm setup");
    bootstrap_->broadcast(
        Tensor(&id, DType::i32, Device{}, {static_cast<int64_t>(sizeof id / sizeof(int32_t))}), 0);
    ncclComm_t comm = nullptr;
    {
      auto guard = watchdog_->watch("ncclCommInitRank");
      MOE_NCCL_CHECK(ncclCommInitRank(&comm, info.world, id, info.rank), "comm setup");
    }
    comm_.store(comm);
  }

  ~NcclComm() override {
    bool failing = std::uncaught_exceptions() > 0;
    if (failing) mpi_mark_failed();
    ncclComm_t comm = comm_.load();
    if (comm && !failing) {
      // Waits for this rank's collectives; a dead peer makes the watchdog end it.
      auto guard = watchdog_->watch("ncclCommFinalize");
      if (nccl_finalize(comm) != ncclSuccess) failing = true;
    }
    watchdog_.reset();  // joins the thread: nothing polls comm_ or the events below any more
    if (comm) (void)(failing ? ncclCommAbort(comm) : ncclCommDestroy(comm));
    for (void* e : pending_.events()) cudaEventDestroy(static_cast<cudaEvent_t>(e));
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    if (fork_event_) cudaEventDestroy(fork_event_);
    if (join_event_) cudaEventDestroy(join_event_);
    if (side_stream_) cudaStreamDestroy(side_stream_);
  }

  const char* backend() const override { return "nccl"; }

  void set_stream(void* stream) override {
    compute_stream_ = stream ? static_cast<cudaStream_t>(stream)
                             : static_cast<cudaStream_t>(gpu::default_stream(device().index));
    stream_ = compute_stream_;
  }

  // The side stream waits (on the GPU) for the compute stream's work so far; collectives go
  // there until join_compute(). One event serves every fork: a wait takes the event's latest
  // record at the time it is queued.
  void fork_from_compute() override {
    const char* op = "fork_from_compute";
    if (!side_stream_) {
      MOE_COMM_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking), op);
      MOE_COMM_CUDA_CHECK(cudaEventCreateWithFlags(&fork_event_, cudaEventDisableTiming), op);
      MOE_COMM_CUDA_CHECK(cudaEventCreateWithFlags(&join_event_, cudaEventDisableTiming), op);
    }
    MOE_COMM_CUDA_CHECK(cudaEventRecord(fork_event_, compute_stream_), op);
    MOE_COMM_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, fork_event_, 0), op);
    stream_ = side_stream_;
  }

  void join_compute() override {
    if (stream_ != side_stream_) return;
    const char* op = "join_compute";
    MOE_COMM_CUDA_CHECK(cudaEventRecord(join_event_, side_stream_), op);
    MOE_COMM_CUDA_CHECK(cudaStreamWaitEvent(compute_stream_, join_event_, 0), op);
    stream_ = compute_stream_;
  }

  void all_reduce_sum(Tensor t) override {
    const char* op = "all_reduce_sum";
    check_tensor(*this, t, op, "inout", nccl_accepts, DTypeUse::reduce);
    auto guard = watchdog_->watch(op);
    Bracket bracket = begin(op);
    MOE_NCCL_CHECK(ncclAllReduce(t.data, t.data, static_cast<size_t>(t.numel()), nccl_type(t.dtype),
                                 ncclSum, comm_.load(), stream_),
                   op);
    enqueued(bracket);
  }

  void reduce_sum(Tensor t, int root) override {
    const char* op = "reduce_sum";
    check_tensor(*this, t, op, "inout", nccl_accepts, DTypeUse::reduce);
    check_root(*this, root, op);
    auto guard = watchdog_->watch(op);
    Bracket bracket = begin(op);
    MOE_NCCL_CHECK(ncclReduce(t.data, t.data, static_cast<size_t>(t.numel()), nccl_type(t.dtype),
                              ncclSum, root, comm_.load(), stream_),
                   op);
    enqueued(bracket);
  }

  void reduce_scatter_sum(Tensor out, Tensor in) override {
    const char* op = "reduce_scatter_sum";
    check_tensor(*this, out, op, "out", nccl_accepts, DTypeUse::reduce);
    check_tensor(*this, in, op, "in", nccl_accepts, DTypeUse::reduce);
    check_reduce_scatter(*this, out, in, op);  // NCCL's in-place layout is ours
    auto guard = watchdog_->watch(op);
    Bracket bracket = begin(op);
    MOE_NCCL_CHECK(ncclReduceScatter(in.data, out.data, static_cast<size_t>(out.numel()),
                                     nccl_type(in.dtype), ncclSum, comm_.load(), stream_),
                   op);
    enqueued(bracket);
  }

  void all_gather(Tensor out, Tensor in) override {
    const char* op = "all_gather";
    check_tensor(*this, out, op, "out", nccl_accepts, DTypeUse::move);
    check_tensor(*this, in, op, "in", nccl_accepts, DTypeUse::move);
    check_all_gather(*this, out, in, op);
    auto guard = watchdog_->watch(op);
    Bracket bracket = begin(op);
    MOE_NCCL_CHECK(ncclAllGather(in.data, out.data, static_cast<size_t>(in.numel()),
                                 nccl_type(in.dtype), comm_.load(), stream_),
                   op);
    enqueued(bracket);
  }

  void all_to_all_v(Tensor out, const std::vector<int64_t>& out_counts, Tensor in,
                    const std::vector<int64_t>& in_counts) override {
    const char* op = "all_to_all_v";
    check_tensor(*this, out, op, "out", nccl_accepts, DTypeUse::move);
    check_tensor(*this, in, op, "in", nccl_accepts, DTypeUse::move);
    AllToAllPlan plan = check_all_to_all_v(*this, out, out_counts, in, in_counts, op);
    const size_t row_bytes = static_cast<size_t>(plan.row_elems) * dtype_size(in.dtype);
    const ncclDataType_t type = nccl_type(in.dtype);
    auto guard = watchdog_->watch(op);
    Bracket bracket = begin(op);
    // This rank's own rows are a local copy; zero counts post nothing (both sides agree on them).
    copy_bytes(device(), bytes(out) + plan.recv_offsets[rank()] * row_bytes,
               bytes(in) + plan.send_offsets[rank()] * row_bytes, in_counts[rank()] * row_bytes,
               stream_);
    MOE_NCCL_CHECK(ncclGroupStart(), op);
    for (int p = 0; p < world(); ++p) {
      if (p == rank()) continue;
      if (in_counts[p] > 0)
        MOE_NCCL_CHECK(ncclSend(bytes(in) + plan.send_offsets[p] * row_bytes,
                                static_cast<size_t>(in_counts[p] * plan.row_elems), type, p,
                                comm_.load(), stream_),
                       op);
      if (out_counts[p] > 0)
        MOE_NCCL_CHECK(ncclRecv(bytes(out) + plan.recv_offsets[p] * row_bytes,
                                static_cast<size_t>(out_counts[p] * plan.row_elems), type, p,
                                comm_.load(), stream_),
                       op);
    }
    MOE_NCCL_CHECK(ncclGroupEnd(), op);
    enqueued(bracket);
  }

  void broadcast(Tensor t, int root) override {
    const char* op = "broadcast";
    check_tensor(*this, t, op, "t", nccl_accepts, DTypeUse::move);
    check_root(*this, root, op);
    auto guard = watchdog_->watch(op);
    Bracket bracket = begin(op);
    MOE_NCCL_CHECK(ncclBroadcast(t.data, t.data, static_cast<size_t>(t.numel()), nccl_type(t.dtype),
                                 root, comm_.load(), stream_),
                   op);
    enqueued(bracket);
  }

  // Not a collective (no watchdog deadline): a stream-ordered copy where the next one goes.
  void copy_from_host(Tensor dst, const void* src) override {
    check_tensor(*this, dst, "copy_from_host", "dst", nccl_accepts, DTypeUse::move);
    copy_bytes(device(), dst.data, src, dst.nbytes(), stream_);
  }

  void copy_to_host(void* dst, Tensor src) override {
    check_tensor(*this, src, "copy_to_host", "src", nccl_accepts, DTypeUse::move);
    copy_bytes(device(), dst, src.data, src.nbytes(), stream_);
  }

  void after_queued(std::function<void()> fn) override {
    gpu::launch_host_func(stream_, std::move(fn));
  }

  void barrier() override {
    // Not armed: the wait may cover a long stretch of compute, and the collectives in it are
    // timed by their own events (poll), which catch a dead peer.
    MOE_COMM_CUDA_CHECK(cudaStreamSynchronize(compute_stream_), "barrier");
    if (side_stream_) MOE_COMM_CUDA_CHECK(cudaStreamSynchronize(side_stream_), "barrier");
    bootstrap_->barrier();
  }

 private:
  // The events around one collective (none when the watchdog has no deadline). enqueued() hands
  // them to the watchdog; a collective that throws before that gives them back here instead.
  struct Bracket {
    NcclComm* owner;
    const char* op;
    cudaEvent_t start = nullptr, end = nullptr;
    Bracket(NcclComm* o, const char* name) : owner(o), op(name) {}
    Bracket(Bracket&& b) noexcept : owner(b.owner), op(b.op), start(b.start), end(b.end) {
      b.start = b.end = nullptr;
    }
    Bracket(const Bracket&) = delete;
    Bracket& operator=(const Bracket&) = delete;
    ~Bracket() {
      if (!start && !end) return;
      std::lock_guard<std::mutex> lock(owner->pending_mu_);
      for (cudaEvent_t e : {start, end})
        if (e) owner->free_events_.push_back(e);
    }
  };

  cudaEvent_t take_event(const char* op) {
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    MOE_COMM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), op);
    return e;
  }

  // Records the event that marks the stream reaching `op` (its deadline starts there).
  Bracket begin(const char* op) {
    Bracket b(this, op);
    if (timeout_s() <= 0) return b;
    std::lock_guard<std::mutex> lock(pending_mu_);
    b.start = take_event(op);
    b.end = take_event(op);
    MOE_COMM_CUDA_CHECK(cudaEventRecord(b.start, stream_), op);
    return b;
  }

  // Records the event after the collective and hands both to the watchdog's poll.
  void enqueued(Bracket& b) {
    if (!b.start) return;
    std::lock_guard<std::mutex> lock(pending_mu_);
    MOE_COMM_CUDA_CHECK(cudaEventRecord(b.end, stream_), b.op);
    pending_.push(b.op, b.start, b.end);
    b.start = b.end = nullptr;  // the watchdog's now
  }

  // The watchdog's hook: "" while healthy, else the line to print before aborting.
  std::string poll() {
    if (ncclComm_t comm = comm_.load()) {
      ncclResult_t async = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm, &async);
      if (r != ncclSuccess) async = r;
      if (async != ncclSuccess && async != ncclInProgress) {
        const char* last = nccl_last_error(comm);
        return "moe-train: rank " + std::to_string(rank()) +
               ": NCCL error: " + ncclGetErrorString(async) +
               (last && *last ? std::string(" (") + last + ")" : "") + "; aborting";
      }
    }
    std::lock_guard<std::mutex> lock(pending_mu_);
    if (pending_.empty()) return "";
    cudaSetDevice(device().index);  // this thread's current device, for the event queries
    std::vector<void*> released;
    const std::string line = pending_.check(
        QueuedDeadlines::Clock::now(),
        [](void* event, std::string* error) {
          const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
          if (e == cudaSuccess) return QueuedDeadlines::EventState::done;
          if (e == cudaErrorNotReady) return QueuedDeadlines::EventState::pending;
          *error = cudaGetErrorString(e);
          return QueuedDeadlines::EventState::failed;
        },
        rank(), &released);
    for (void* e : released) free_events_.push_back(static_cast<cudaEvent_t>(e));
    return line;
  }

  std::unique_ptr<Comm> bootstrap_;  // MpiComm: the unique id, the host side of barrier
  std::atomic<ncclComm_t> comm_{nullptr};
  cudaStream_t stream_ = nullptr;          // where collectives are enqueued now
  cudaStream_t compute_stream_ = nullptr;  // set_stream's
  cudaStream_t side_stream_ = nullptr;     // fork_from_compute's, created on first use
  cudaEvent_t fork_event_ = nullptr, join_event_ = nullptr;
  std::mutex pending_mu_;
  QueuedDeadlines pending_{timeout_s()};
  std::vector<cudaEvent_t> free_events_;
  std::unique_ptr<Watchdog> watchdog_;  // last: stopped first, while the rest still exists
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(const RankInfo& info, double timeout_s) {
  const int gpu = pick_local_gpu(info, gpu::device_count());         // before any MPI traffic
  std::unique_ptr<Comm> bootstrap = make_mpi_comm(info, timeout_s);  // checks the MPI job
  return std::make_unique<NcclComm>(info, gpu, timeout_s, std::move(bootstrap));
}

}  // namespace moe::dist
#endif
