// The collectives across real ranks: run only under mpirun (tests/mpi/run_mpi.sh), never alone.
//   test_comm_mpi check      every collective against values computed locally (each rank can
//                            regenerate every peer's seeded data), all_reduce bits equal on all
//                            ranks, uneven all_to_all_v with zero counts, in-place forms
//   test_comm_mpi hang       rank 1 sleeps before a collective: the others' watchdog (2 s) must
//                            print its line and end the job
//   test_comm_mpi exit       rank 1 fails with an exception mid-run (timeout 60 s): the launcher,
//                            not the watchdog, must end the job promptly
//   test_comm_mpi mpi_error  a broadcast whose sizes disagree: MPI's error becomes a CommError
// Own main (no Catch2): a failed check on one rank must not leave the others in a collective, so
// checks are counted and the counts summed across ranks at the end.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "moe/comm.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/error.hpp"
#include "parallel/mpi_runtime.hpp"

using namespace moe;

namespace {

int g_rank = 0;
int g_failures = 0;

void expect(bool ok, const std::string& what) {
  if (ok) return;
  ++g_failures;
  std::fprintf(stderr, "rank %d: FAILED: %s\n", g_rank, what.c_str());
}

template <class T>
Tensor view(std::vector<T>& v, std::initializer_list<int64_t> dims, DType t = dtype_of<T>()) {
  return Tensor(v.data(), t, Device{}, dims);
}

// Rank r's data for test `tag`: seeded by (tag, r), never zero.
template <class T>
std::vector<T> rank_data(int tag, int r, size_t n) {
  std::mt19937_64 rng(static_cast<uint64_t>(tag) * 1000003u + static_cast<uint64_t>(r));
  std::vector<T> v(n);
  if constexpr (std::is_floating_point_v<T>) {
    std::uniform_real_distribution<double> mag(0.5, 1.5);
    for (T& x : v) x = static_cast<T>((rng() & 1 ? 1 : -1) * mag(rng));
  } else {
    std::uniform_int_distribution<int> mag(1, 1000);
    for (T& x : v) x = static_cast<T>((rng() & 1 ? 1 : -1) * mag(rng));
  }
  return v;
}

// Sum over ranks in double (exact for i32), the reference for the reductions.
template <class T>
std::vector<double> reference_sum(int tag, int world, size_t n) {
  std::vector<double> sum(n, 0.0);
  for (int r = 0; r < world; ++r) {
    std::vector<T> v = rank_data<T>(tag, r, n);
    for (size_t i = 0; i < n; ++i) sum[i] += static_cast<double>(v[i]);
  }
  return sum;
}

template <class T>
bool close_to(const std::vector<T>& got, const std::vector<double>& want, size_t offset = 0) {
  const double tol = std::is_same_v<T, float> ? 1e-5 : std::is_same_v<T, double> ? 1e-12 : 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    double w = want[offset + i];
    if (std::fabs(static_cast<double>(got[i]) - w) > tol * (1.0 + std::fabs(w))) return false;
  }
  return true;
}

uint64_t fnv1a(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i)
    h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  return h;
}

// Whether every rank holds the same bytes in `v` (hashes gathered with all_gather).
template <class T>
bool same_bits_everywhere(Comm& comm, const std::vector<T>& v) {
  uint64_t h = fnv1a(v.data(), v.size() * sizeof(T));
  std::vector<int32_t> mine(2), all(2 * static_cast<size_t>(comm.world()));
  std::memcpy(mine.data(), &h, sizeof h);
  comm.all_gather(view(all, {static_cast<int64_t>(all.size())}), view(mine, {2}));
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i] != mine[i % 2]) return false;
  return true;
}

template <class T>
void check_all_reduce(Comm& comm, int tag, const char* name) {
  const size_t n = 1000 + 37;  // not a multiple of the world size
  std::vector<T> v = rank_data<T>(tag, comm.rank(), n);
  comm.all_reduce_sum(view(v, {static_cast<int64_t>(n)}));
  expect(close_to(v, reference_sum<T>(tag, comm.world(), n)),
         std::string("all_reduce_sum ") + name + " matches the local sum");
  expect(same_bits_everywhere(comm, v),
         std::string("all_reduce_sum ") + name + " gives the same bits on every rank");
}

// Every rank as the root in turn; the others' buffers are unspecified afterwards (not checked).
template <class T>
void check_reduce(Comm& comm, int tag, const char* name) {
  const size_t n = 1000 + 37;
  for (int root = 0; root < comm.world(); ++root) {
    std::vector<T> v = rank_data<T>(tag, comm.rank(), n);
    comm.reduce_sum(view(v, {static_cast<int64_t>(n)}), root);
    if (comm.rank() == root)
      expect(close_to(v, reference_sum<T>(tag, comm.world(), n)),
             std::string("reduce_sum ") + name + " matches the local sum at root " +
                 std::to_string(root));
  }
}

template <class T>
void check_reduce_scatter(Comm& comm, int tag, const char* name) {
  const auto world = static_cast<size_t>(comm.world());
  const size_t n = 53, r = static_cast<size_t>(comm.rank());
  std::vector<double> sum = reference_sum<T>(tag, comm.world(), world * n);
  std::vector<T> in = rank_data<T>(tag, comm.rank(), world * n), out(n);
  comm.reduce_scatter_sum(view(out, {static_cast<int64_t>(n)}),
                          view(in, {static_cast<int64_t>(world), static_cast<int64_t>(n)}));
  expect(close_to(out, sum, r * n), std::string("reduce_scatter_sum ") + name);
  // in place: out is chunk `rank` of in
  in = rank_data<T>(tag, comm.rank(), world * n);
  comm.reduce_scatter_sum(Tensor(in.data() + r * n, dtype_of<T>(), Device{}, {int64_t(n)}),
                          view(in, {static_cast<int64_t>(world * n)}));
  std::vector<T> chunk(in.begin() + static_cast<long>(r * n),
                       in.begin() + static_cast<long>(r * n + n));
  expect(close_to(chunk, sum, r * n), std::string("reduce_scatter_sum in place ") + name);
}

template <class T>
void check_all_gather(Comm& comm, int tag, const char* name, DType dtype = dtype_of<T>()) {
  const auto world = static_cast<size_t>(comm.world());
  const size_t n = 41, r = static_cast<size_t>(comm.rank());
  std::vector<T> want;
  for (int p = 0; p < comm.world(); ++p) {
    std::vector<T> v = rank_data<T>(tag, p, n);
    want.insert(want.end(), v.begin(), v.end());
  }
  std::vector<T> in = rank_data<T>(tag, comm.rank(), n), out(world * n);
  comm.all_gather(view(out, {static_cast<int64_t>(world * n)}, dtype),
                  view(in, {static_cast<int64_t>(n)}, dtype));
  expect(out == want, std::string("all_gather ") + name);
  // in place: in is chunk `rank` of out
  std::vector<T> buf(world * n);
  std::memcpy(buf.data() + r * n, in.data(), n * sizeof(T));
  comm.all_gather(view(buf, {static_cast<int64_t>(world), static_cast<int64_t>(n)}, dtype),
                  Tensor(buf.data() + r * n, dtype, Device{}, {static_cast<int64_t>(n)}));
  expect(buf == want, std::string("all_gather in place ") + name);
}

// Rows from src to dst: uneven, and zero for some pairs (including some self pairs).
int64_t rows_between(int src, int dst) {
  return (2 * src + dst) % 4 == 1 ? 0 : src + dst + 1;
}

// Row j from src to dst, column c: values that name their origin exactly.
template <class T>
T cell(int src, int dst, int64_t j, int64_t c) {
  return static_cast<T>(src * 10000 + dst * 1000 + j * 10 + c + 1);
}

template <class T>
void check_all_to_all_v(Comm& comm, const char* name, DType dtype = dtype_of<T>()) {
  const int64_t cols = 3;
  const int me = comm.rank();
  std::vector<int64_t> in_counts, out_counts;
  std::vector<T> in, want;
  for (int p = 0; p < comm.world(); ++p) {
    in_counts.push_back(rows_between(me, p));
    out_counts.push_back(rows_between(p, me));
    for (int64_t j = 0; j < in_counts.back(); ++j)
      for (int64_t c = 0; c < cols; ++c) in.push_back(cell<T>(me, p, j, c));
    for (int64_t j = 0; j < out_counts.back(); ++j)
      for (int64_t c = 0; c < cols; ++c) want.push_back(cell<T>(p, me, j, c));
  }
  std::vector<T> out(want.size(), T(0));
  comm.all_to_all_v(view(out, {static_cast<int64_t>(want.size()) / cols, cols}, dtype), out_counts,
                    view(in, {static_cast<int64_t>(in.size()) / cols, cols}, dtype), in_counts);
  expect(out == want, std::string("all_to_all_v ") + name);

  // everything to one peer, nothing to the others
  const int target = comm.world() - 1;
  std::vector<int64_t> send(static_cast<size_t>(comm.world()), 0), recv(send);
  send[static_cast<size_t>(target)] = 2;
  if (me == target) std::fill(recv.begin(), recv.end(), 2);
  std::vector<T> in2(2 * cols, static_cast<T>(me + 1)),
      out2(me == target ? 2 * cols * comm.world() : 0);
  comm.all_to_all_v(view(out2, {static_cast<int64_t>(out2.size()) / cols, cols}, dtype), recv,
                    view(in2, {2, cols}, dtype), send);
  bool ok = true;
  for (size_t i = 0; i < out2.size(); ++i)
    ok = ok && out2[i] == static_cast<T>(i / static_cast<size_t>(2 * cols) + 1);
  expect(ok, std::string("all_to_all_v to one peer ") + name);
}

template <class T>
void check_broadcast(Comm& comm, int tag, const char* name) {
  for (int root = 0; root < comm.world(); ++root) {
    std::vector<T> v = rank_data<T>(tag, comm.rank(), 77);
    comm.broadcast(view(v, {7, 11}), root);
    expect(v == rank_data<T>(tag, root, 77),
           std::string("broadcast ") + name + " from root " + std::to_string(root));
  }
}

int run_checks(Comm& comm) {
  expect(std::string(comm.backend()) == "mpi", "make_comm gives MpiComm for CPU ranks");
  comm.barrier();
  check_all_reduce<float>(comm, 1, "f32");
  check_all_reduce<double>(comm, 2, "f64");
  check_all_reduce<int32_t>(comm, 3, "i32");
  comm.all_reduce_sum(Tensor(nullptr, DType::f32, Device{}, {0}));
  check_reduce_scatter<float>(comm, 4, "f32");
  check_reduce_scatter<double>(comm, 5, "f64");
  check_reduce_scatter<int32_t>(comm, 6, "i32");
  check_all_gather<float>(comm, 7, "f32");
  check_all_gather<int32_t>(comm, 8, "i32");
  check_all_gather<uint16_t>(comm, 9, "bf16 (moved as 16-bit words)", DType::bf16);
  check_all_to_all_v<float>(comm, "f32");
  check_all_to_all_v<double>(comm, "f64");
  check_all_to_all_v<uint16_t>(comm, "f16 (moved as 16-bit words)", DType::f16);
  check_broadcast<double>(comm, 10, "f64");
  check_broadcast<int32_t>(comm, 11, "i32");
  check_reduce<float>(comm, 13, "f32");
  check_reduce<double>(comm, 14, "f64");
  check_reduce<int32_t>(comm, 15, "i32");

  // Contract errors are thrown on every rank before any message moves: the job goes on.
  std::vector<uint16_t> half(4);
  bool threw = false;
  try {
    comm.all_reduce_sum(view(half, {4}, DType::f16));
  } catch (const InternalError& e) {
    threw =
        std::string(e.what()).find("not supported by mpi comm for reductions") != std::string::npos;
  }
  expect(threw, "MpiComm refuses f16 reductions with a clear InternalError");

  // A RankInfo that is not MPI's view of the job is a CommError naming the fix.
  RankInfo wrong = comm.info();
  wrong.world += 1;
  wrong.local_world = wrong.world;
  std::string msg;
  try {
    make_comm(wrong, Device{}, 5.0);
  } catch (const CommError& e) {
    msg = e.what();
  }
  expect(msg.find("did not start as one MPI job") != std::string::npos,
         "a launcher/MPI mismatch is a clear CommError (got '" + msg + "')");

  // The thread level: MULTIPLE by default (the watchdog thread may call MPI_Abort), SERIALIZED
  // when MOE_MPI_THREAD_LEVEL asks for it; a bad value is refused before MPI starts.
  const char* asked = std::getenv("MOE_MPI_THREAD_LEVEL");
  const int want_level =
      asked && std::string(asked) == "serialized" ? MPI_THREAD_SERIALIZED : MPI_THREAD_MULTIPLE;
  expect(dist::mpi_thread_level() == want_level,
         std::string("MPI granted ") + dist::mpi_thread_level_name(dist::mpi_thread_level()) +
             ", expected " + dist::mpi_thread_level_name(want_level));
  std::string level_msg;
  try {
    dist::mpi_requested_thread_level("funneled");
  } catch (const InputError& e) {
    level_msg = e.what();
  }
  expect(level_msg.find("MOE_MPI_THREAD_LEVEL: \"funneled\"") != std::string::npos,
         "a bad MOE_MPI_THREAD_LEVEL is an InputError naming it (got '" + level_msg + "')");

  // A GPU comm needs NCCL and a GPU per local rank; without them the error says so, before any
  // MPI traffic (so all ranks can go on).
  if (gpu::device_count() == 0) {
    std::string gpu_msg;
    try {
      make_comm(comm.info(), Device{DeviceType::cuda, 0}, 5.0);
    } catch (const std::exception& e) {
      gpu_msg = e.what();
    }
#ifdef MOE_WITH_NCCL
    const char* want = "sees no GPU";
#else
    const char* want = "this build has no NCCL";
#endif
    expect(gpu_msg.find(want) != std::string::npos,
           std::string("a GPU comm without GPU/NCCL fails with '") + want + "' (got '" + gpu_msg +
               "')");
  }

  // An exception that unwinds through a comm marks the process as failing (no MPI_Finalize at
  // exit); when it is caught and the run goes on, the next collective clears that, so this
  // process still finalises and the job exits 0.
  try {
    std::unique_ptr<Comm> scoped = make_comm(comm.info(), Device{}, 30.0);
    scoped->barrier();
    throw std::runtime_error("caught below");
  } catch (const std::runtime_error&) {
  }
  comm.barrier();

  // A second comm on the same MPI works alongside the first.
  std::unique_ptr<Comm> second = make_comm(comm.info(), Device{}, 30.0);
  check_all_reduce<float>(*second, 12, "f32 on a second comm");
  second.reset();

  std::vector<int32_t> failures = {g_failures};
  comm.all_reduce_sum(view(failures, {1}));
  if (comm.rank() == 0)
    std::printf("test_comm_mpi: %d ranks, %d failed checks\n", comm.world(), failures[0]);
  return failures[0] == 0 ? 0 : 1;
}

int run(const std::string& mode) {
  RankInfo info = detect_ranks();
  g_rank = info.rank;
  if (info.world < 2) {
    std::fprintf(stderr, "test_comm_mpi: run me under mpirun with -np >= 2 (see tests/mpi/)\n");
    return 2;
  }
  if (mode == "check") {
    std::unique_ptr<Comm> comm = make_comm(info, Device{}, 30.0);
    return run_checks(*comm);
  }
  if (mode == "hang") {
    std::unique_ptr<Comm> comm = make_comm(info, Device{}, 2.0);
    comm->barrier();
    if (comm->rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
    std::vector<float> v(16, 1.0f);
    comm->all_reduce_sum(view(v, {16}));
    std::fprintf(stderr, "rank %d: FAILED: all_reduce_sum returned although rank 1 hangs\n",
                 g_rank);
    return 1;
  }
  if (mode == "exit") {
    std::unique_ptr<Comm> comm = make_comm(info, Device{}, 60.0);
    std::vector<float> v(16, 1.0f);
    comm->all_reduce_sum(view(v, {16}));
    if (comm->rank() == 1) throw std::runtime_error("deliberate failure on rank 1 mid-run");
    comm->barrier();  // the others wait here for rank 1, which is gone
    std::fprintf(stderr, "rank %d: FAILED: barrier returned although rank 1 exited\n", g_rank);
    return 1;
  }
  if (mode == "mpi_error") {
    std::unique_ptr<Comm> comm = make_comm(info, Device{}, 20.0);
    comm->barrier();
    // The root sends 64 elements, the others expect 8: MPI reports a truncation.
    std::vector<int32_t> v(comm->rank() == 0 ? 64 : 8, 5);
    comm->broadcast(view(v, {static_cast<int64_t>(v.size())}), 0);
    if (comm->rank() == 0) comm->barrier();  // the others are gone: the launcher ends the job
    std::fprintf(stderr, "rank %d: FAILED: a truncated broadcast returned\n", g_rank);
    return 1;
  }
  std::fprintf(stderr, "test_comm_mpi: unknown mode '%s' (check, hang, exit, mpi_error)\n",
               mode.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  try {
    return run(mode);
  } catch (const std::exception& e) {
    // as moe-train's main: one line, exit 1
    std::fprintf(stderr, "error: rank %d: %s\n", g_rank, e.what());
    return 1;
  }
}
