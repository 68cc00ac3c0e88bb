// The MPI library's lifetime in this process: initialised once by the first multi-rank comm,
// finalised at exit, skipped when the process is failing, and errors turned into CommError.
#pragma once
#ifdef MOE_WITH_MPI
// The C API only: the deprecated C++ bindings would drag libmpi_cxx symbols into every object.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <string>

namespace moe::dist {

// MPI_Init_thread (MPI_THREAD_MULTIPLE requested: the watchdog thread may call MPI_Abort while
// the main thread is inside a collective) unless MPI is initialised already; in that case the
// owner finalises it. Otherwise MPI_Finalize runs at exit.
void mpi_init_once();

// The process is failing (an MPI error, an exception unwinding through a comm): skip MPI_Finalize
// at exit. Its fence would wait for peers that are blocked in a collective with this rank; without
// it the launcher sees a rank exit without finalising and ends the job at once.
void mpi_mark_failed();
// A collective completed: the ranks are in step again (an exception was caught and the run went
// on), so MPI_Finalize at exit is safe once more.
void mpi_mark_healthy();

// MPI_Abort on MPI_COMM_WORLD: the launcher kills every rank of the job.
[[noreturn]] void mpi_abort_job(int code);

// Throws CommError for a failed MPI call: "MPI error in <op> (<call>) on rank R at file:line: ...".
void mpi_check(int err, const char* call, const char* op, int rank, const char* file, int line);

}  // namespace moe::dist

#define MOE_MPI_CHECK(call, op, rank) \
  ::moe::dist::mpi_check((call), #call, (op), (rank), __FILE__, __LINE__)

#endif
