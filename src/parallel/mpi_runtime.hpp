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

// MPI_Init_thread unless MPI is initialised already (then the owner finalises it; otherwise
// MPI_Finalize runs at exit). The level requested is MPI_THREAD_MULTIPLE, because the watchdog
// thread may call MPI_Abort while the main thread is inside a collective; the environment
// variable MOE_MPI_THREAD_LEVEL=serialized asks for MPI_THREAD_SERIALIZED instead (for an MPI
// whose MULTIPLE mode is slow or broken). Whatever is granted is recorded: below MULTIPLE,
// mpi_abort_job ends this rank with _exit instead of MPI_Abort, and a one-line note says so.
void mpi_init_once();

// The thread level MPI granted (MPI_Query_thread); MPI must be initialised.
int mpi_thread_level();
// "MPI_THREAD_SINGLE", ... for messages.
const char* mpi_thread_level_name(int level);
// Parses MOE_MPI_THREAD_LEVEL ("" or "multiple" -> MPI_THREAD_MULTIPLE, "serialized" ->
// MPI_THREAD_SERIALIZED); anything else is an InputError naming the variable.
int mpi_requested_thread_level(const char* value);

// The process is failing (an MPI error, an exception unwinding through a comm): skip MPI_Finalize
// at exit. Its fence would wait for peers that are blocked in a collective with this rank; without
// it the launcher sees a rank exit without finalising and ends the job at once.
void mpi_mark_failed();
// A collective completed: the ranks are in step again (an exception was caught and the run went
// on), so MPI_Finalize at exit is safe once more.
void mpi_mark_healthy();

// Called from the watchdog thread to end the job. With MPI_THREAD_MULTIPLE: MPI_Abort on
// MPI_COMM_WORLD (the launcher kills every rank). Below it, calling MPI from this thread while
// the main thread is inside MPI is not allowed, so the rank _exits: the launcher sees a rank end
// without finalising and ends the job (mpirun at once; srun with --kill-on-bad-exit=1).
[[noreturn]] void mpi_abort_job(int code);

// Throws CommError for a failed MPI call: "MPI error in <op> (<call>) on rank R at file:line: ...".
void mpi_check(int err, const char* call, const char* op, int rank, const char* file, int line);

}  // namespace moe::dist

#define MOE_MPI_CHECK(call, op, rank) \
  ::moe::dist::mpi_check((call), #call, (op), (rank), __FILE__, __LINE__)

#endif
