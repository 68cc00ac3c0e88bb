#ifdef MOE_WITH_MPI
#include "parallel/mpi_runtime.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "moe/comm.hpp"

namespace moe::dist {

namespace {

std::atomic<bool> g_failed{false};

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || g_failed.load()) return;
  MPI_Finalize();
}

}  // namespace

void mpi_init_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) return;  // someone else owns MPI's lifetime
    int provided = 0;
    int err = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (err != MPI_SUCCESS)
      throw CommError("MPI_Init_thread failed (error " + std::to_string(err) + ")");
    std::atexit(finalize_at_exit);
  });
}

void mpi_mark_failed() {
  g_failed.store(true);
}

void mpi_mark_healthy() {
  g_failed.store(false, std::memory_order_relaxed);
}

void mpi_abort_job(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  _exit(code);  // MPI_Abort does not return; in case it does
}

void mpi_check(int err, const char* call, const char* op, int rank, const char* file, int line) {
  if (err == MPI_SUCCESS) return;
  mpi_mark_failed();
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(err, text, &len) != MPI_SUCCESS) text[0] = '\0';
  int error_class = 0;
  char class_text[MPI_MAX_ERROR_STRING] = {0};
  if (MPI_Error_class(err, &error_class) == MPI_SUCCESS)
    MPI_Error_string(error_class, class_text, &len);
  std::string detail = text;
  if (class_text[0] && detail != class_text) detail += std::string(" (") + class_text + ")";
  throw CommError("MPI error in " + std::string(op) + " (" + call + ") on rank " +
                  std::to_string(rank) + " at " + file + ":" + std::to_string(line) + ": " +
                  detail);
}

}  // namespace moe::dist
#endif
