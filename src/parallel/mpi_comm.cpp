// MpiComm: the collectives on CPU tensors over MPI, on a private duplicate of MPI_COMM_WORLD
// whose error handler returns errors (MPI_ERRORS_RETURN) so that a failed call becomes a CommError
// naming the operation instead of MPI's generic abort.
//
// Determinism: all_reduce_sum is MPI_Allreduce. MPI advises implementations to give every rank
// the same result, and Open MPI's algorithms do (recursive doubling combines the same two partial
// sums on both partners, ring and Rabenseifner reduce each chunk once and distribute it); the
// multi-rank test checks the bits. Results can differ from a serial sum and between world sizes.
#ifdef MOE_WITH_MPI
#include <algorithm>
#include <climits>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "parallel/comm_impl.hpp"
#include "parallel/mpi_runtime.hpp"
#include "parallel/watchdog.hpp"
#include "moe/error.hpp"

namespace moe::dist {

namespace {

// MPI counts are int: long buffers go in chunks of this many elements.
constexpr int64_t kMaxChunk = int64_t{1} << 30;

bool mpi_accepts(DType t, DTypeUse use) {
  if (t == DType::f32 || t == DType::f64 || t == DType::i32) return true;
  return use == DTypeUse::move;  // f16 / bf16: moved as 16-bit words, never summed
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i32:
      return MPI_INT32_T;
    case DType::f16:
    case DType::bf16:
    case DType::u16:
      return MPI_UINT16_T;
  }
  throw InternalError("mpi_type: unknown dtype");
}

char* bytes(const Tensor& t) {
  return static_cast<char*>(t.data);
}

class MpiComm final : public Comm {
 public:
  MpiComm(const RankInfo& info, double timeout_s) : Comm(info, Device{}, timeout_s) {
    if (timeout_s > 0)
      watchdog_ = std::make_unique<Watchdog>(info.rank, timeout_s,
                                             [] { mpi_abort_job(kCommAbortExitCode); });
    auto guard = watch("MPI_Comm_dup");
    MOE_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "comm setup", rank());
    MOE_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "comm setup", rank());
  }

  ~MpiComm() override {
    // Destroyed by an exception on its way to main: this rank is failing (see mpi_mark_failed).
    if (std::uncaught_exceptions() > 0) {
      mpi_mark_failed();
      return;  // the process is going down; leave MPI alone
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  const char* backend() const override { return "mpi"; }
  void set_stream(void*) override {}

  void all_reduce_sum(Tensor t) override {
    const char* op = "all_reduce_sum";
    check_tensor(*this, t, op, "inout", mpi_accepts, DTypeUse::reduce);
    auto guard = watch(op);
    const size_t es = dtype_size(t.dtype);
    for (int64_t begin = 0; begin < t.numel(); begin += kMaxChunk) {
      int count = static_cast<int>(std::min(kMaxChunk, t.numel() - begin));
      MOE_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, bytes(t) + begin * es, count, mpi_type(t.dtype),
                                  MPI_SUM, comm_),
                    op, rank());
    }
  }

  void reduce_sum(Tensor t, int root) override {
    const char* op = "reduce_sum";
    check_tensor(*this, t, op, "inout", mpi_accepts, DTypeUse::reduce);
    check_root(*this, root, op);
    auto guard = watch(op);
    const size_t es = dtype_size(t.dtype);
    for (int64_t begin = 0; begin < t.numel(); begin += kMaxChunk) {
      int count = static_cast<int>(std::min(kMaxChunk, t.numel() - begin));
      char* at = bytes(t) + begin * es;
      // In place at the root; the others send theirs and leave it as it was.
      MOE_MPI_CHECK(MPI_Reduce(rank() == root ? MPI_IN_PLACE : at, rank() == root ? at : nullptr,
                               count, mpi_type(t.dtype), MPI_SUM, root, comm_),
                    op, rank());
    }
  }

  void reduce_scatter_sum(Tensor out, Tensor in) override {
    const char* op = "reduce_scatter_sum";
    check_tensor(*this, out, op, "out", mpi_accepts, DTypeUse::reduce);
    check_tensor(*this, in, op, "in", mpi_accepts, DTypeUse::reduce);
    const bool in_place = check_reduce_scatter(*this, out, in, op);
    const int count = int_count(out.numel(), op);
    auto guard = watch(op);
    if (in_place) {
      // MPI's in-place form reads all of `in` and writes the result at its start.
      MOE_MPI_CHECK(MPI_Reduce_scatter_block(MPI_IN_PLACE, in.data, count, mpi_type(in.dtype),
                                             MPI_SUM, comm_),
                    op, rank());
      std::memmove(out.data, in.data, out.nbytes());
    } else {
      MOE_MPI_CHECK(
          MPI_Reduce_scatter_block(in.data, out.data, count, mpi_type(in.dtype), MPI_SUM, comm_),
          op, rank());
    }
  }

  void all_gather(Tensor out, Tensor in) override {
    const char* op = "all_gather";
    check_tensor(*this, out, op, "out", mpi_accepts, DTypeUse::move);
    check_tensor(*this, in, op, "in", mpi_accepts, DTypeUse::move);
    const bool in_place = check_all_gather(*this, out, in, op);
    const int count = int_count(in.numel(), op);
    const MPI_Datatype type = mpi_type(in.dtype);
    auto guard = watch(op);
    if (in_place)
      MOE_MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out.data, count, type, comm_),
                    op, rank());
    else
      MOE_MPI_CHECK(MPI_Allgather(in.data, count, type, out.data, count, type, comm_), op, rank());
  }

  void all_to_all_v(Tensor out, const std::vector<int64_t>& out_counts, Tensor in,
                    const std::vector<int64_t>& in_counts) override {
    const char* op = "all_to_all_v";
    check_tensor(*this, out, op, "out", mpi_accepts, DTypeUse::move);
    check_tensor(*this, in, op, "in", mpi_accepts, DTypeUse::move);
    AllToAllPlan plan = check_all_to_all_v(*this, out, out_counts, in, in_counts, op);
    // Counts and displacements in rows: one row is a contiguous datatype.
    const auto world = static_cast<size_t>(this->world());
    std::vector<int> send_counts(world), send_displs(world), recv_counts(world), recv_displs(world);
    for (size_t p = 0; p < world; ++p) {
      send_counts[p] = int_count(in_counts[p], op);
      recv_counts[p] = int_count(out_counts[p], op);
      send_displs[p] = int_count(plan.send_offsets[p], op);
      recv_displs[p] = int_count(plan.recv_offsets[p], op);
    }
    MPI_Datatype row = MPI_DATATYPE_NULL;
    MOE_MPI_CHECK(MPI_Type_contiguous(int_count(plan.row_elems, op), mpi_type(in.dtype), &row), op,
                  rank());
    MOE_MPI_CHECK(MPI_Type_commit(&row), op, rank());
    struct FreeType {
      MPI_Datatype* t;
      ~FreeType() { MPI_Type_free(t); }
    } free_row{&row};
    auto guard = watch(op);
    MOE_MPI_CHECK(MPI_Alltoallv(in.data, send_counts.data(), send_displs.data(), row, out.data,
                                recv_counts.data(), recv_displs.data(), row, comm_),
                  op, rank());
  }

  void copy_from_host(Tensor dst, const void* src) override {  // CPU tensors: a plain copy
    check_tensor(*this, dst, "copy_from_host", "dst", mpi_accepts, DTypeUse::move);
    copy_bytes(device(), dst.data, src, dst.nbytes(), nullptr);
  }

  void copy_to_host(void* dst, Tensor src) override {
    check_tensor(*this, src, "copy_to_host", "src", mpi_accepts, DTypeUse::move);
    copy_bytes(device(), dst, src.data, src.nbytes(), nullptr);
  }

  void after_queued(std::function<void()> fn) override { fn(); }

  void broadcast(Tensor t, int root) override {
    const char* op = "broadcast";
    check_tensor(*this, t, op, "t", mpi_accepts, DTypeUse::move);
    check_root(*this, root, op);
    auto guard = watch(op);
    const size_t es = dtype_size(t.dtype);
    for (int64_t begin = 0; begin < t.numel(); begin += kMaxChunk) {
      int count = static_cast<int>(std::min(kMaxChunk, t.numel() - begin));
      MOE_MPI_CHECK(MPI_Bcast(bytes(t) + begin * es, count, mpi_type(t.dtype), root, comm_), op,
                    rank());
    }
  }

  void barrier() override {
    auto guard = watch("barrier");
    MOE_MPI_CHECK(MPI_Barrier(comm_), "barrier", rank());
  }

 private:
  // Arms the watchdog for one collective; a collective that returns normally marks the process
  // healthy again (see mpi_mark_healthy).
  struct Watched {
    Watchdog::Guard guard;
    ~Watched() {
      if (std::uncaught_exceptions() == 0) mpi_mark_healthy();
    }
  };
  Watched watch(const char* op) {
    return Watched{watchdog_ ? watchdog_->watch(op) : Watchdog::Guard(nullptr)};
  }

  int int_count(int64_t n, const char* op) const {
    if (n > INT_MAX)
      throw CommError(std::string(op) + ": " + std::to_string(n) +
                      " exceeds MPI's int count; split the buffer");
    return static_cast<int>(n);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::unique_ptr<Watchdog> watchdog_;
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(const RankInfo& info, double timeout_s) {
  mpi_init_once();
  int rank = 0, world = 0;
  MOE_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "comm setup", info.rank);
  MOE_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world), "comm setup", info.rank);
  if (rank != info.rank || world != info.world)
    throw CommError(
        "the launcher environment (" + info.launcher + ") says rank " + std::to_string(info.rank) +
        " of " + std::to_string(info.world) + ", but MPI_COMM_WORLD has rank " +
        std::to_string(rank) + " of " + std::to_string(world) +
        ": the ranks did not start as one MPI job (under srun, pass --mpi=pmix or "
        "--mpi=pmi2; with mpirun, use the mpirun of the MPI this binary was built with)");
  return std::make_unique<MpiComm>(info, timeout_s);
}

}  // namespace moe::dist
#endif
