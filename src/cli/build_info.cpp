// What this binary was built with, printed at the start of every run.
#include <cblas.h>
#include <omp.h>

#include <string>

#ifdef MOE_WITH_MPI
#include <mpi.h>
#endif

#include "moe/trainer.hpp"

namespace moe {

std::string build_info() {
  std::string s = std::string("moe-train ") + MOE_VERSION + " | CUDA archs: " + MOE_CUDA_ARCHS_STR;
#ifndef MOE_WITH_CUDA
  s += " (CPU-only build)";
#endif
  std::string blas = openblas_get_config();
  s += " | BLAS: " + blas;
#ifdef MOE_WITH_MPI
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(version, &len);
  std::string mpi(version, static_cast<size_t>(len));
  s += " | MPI: " + mpi.substr(0, mpi.find_first_of(",\n"));
#else
  s += " | MPI: none";
#endif
  s += " | OpenMP threads: " + std::to_string(omp_get_max_threads());
  return s;
}

}  // namespace moe
