#ifdef MOE_WITH_MPI
#include "parallel/mpi_runtime.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "moe/comm.hpp"
#include "moe/error.hpp"

namespace moe::dist {

namespace {

std::atomic<bool> g_failed{false};
// The granted level, read by the watchdog thread: MPI_Abort from it needs MPI_THREAD_MULTIPLE.
std::atomic<int> g_thread_level{MPI_THREAD_SINGLE};

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
    int provided = MPI_THREAD_SINGLE;
    if (initialized) {  // someone else owns MPI's lifetime; take the level it got
      MPI_Query_thread(&provided);
    } else {
      const int requested = mpi_requested_thread_level(std::getenv("MOE_MPI_THREAD_LEVEL"));
      int err = MPI_Init_thread(nullptr, nullptr, requested, &provided);
      if (err != MPI_SUCCESS)
        throw CommError("MPI_Init_thread failed (error " + std::to_string(err) + ")");
      std::atexit(finalize_at_exit);
    }
    g_thread_level.store(provided);
    if (provided < MPI_THREAD_MULTIPLE) {
      int rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      if (rank == 0)
        std::fprintf(stderr,
                     "moe-train: MPI granted %s, not MPI_THREAD_MULTIPLE: a rank whose comm "
                     "watchdog fires ends itself with _exit instead of MPI_Abort (the launcher "
                     "then ends the job)\n",
                     mpi_thread_level_name(provided));
    }
  });
}

int mpi_thread_level() {
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  return level;
}

const char* mpi_thread_level_name(int level) {
  if (level == MPI_THREAD_SINGLE) return "MPI_THREAD_SINGLE";
  if (level == MPI_THREAD_FUNNELED) return "MPI_THREAD_FUNNELED";
  if (level == MPI_THREAD_SERIALIZED) return "MPI_THREAD_SERIALIZED";
  if (level == MPI_THREAD_MULTIPLE) return "MPI_THREAD_MULTIPLE";
  return "an unknown MPI thread level";
}

int mpi_requested_thread_level(const char* value) {
  if (value == nullptr || *value == '\0' || std::strcmp(value, "multiple") == 0)
    return MPI_THREAD_MULTIPLE;
  if (std::strcmp(value, "serialized") == 0) return MPI_THREAD_SERIALIZED;
  throw InputError("MOE_MPI_THREAD_LEVEL: \"" + std::string(value) +
                   "\" is not a thread level this trainer can use: \"multiple\" (the default) "
                   "or \"serialized\"");
}

void mpi_mark_failed() {
  g_failed.store(true);
}

void mpi_mark_healthy() {
  g_failed.store(false, std::memory_order_relaxed);
}

void mpi_abort_job(int code) {
  if (g_thread_level.load() >= MPI_THREAD_MULTIPLE) MPI_Abort(MPI_COMM_WORLD, code);
  _exit(code);  // below MULTIPLE (see mpi_runtime.hpp); or MPI_Abort returned, which it should not
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
