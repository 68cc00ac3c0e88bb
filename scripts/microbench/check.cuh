// The microbenchmarks' check: a CUDA runtime or cuBLAS call that returns anything but success (0)
// prints the error (the runtime's name for it where it has one) and the line, and exits.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

inline const char* ck_message(cudaError_t e) {
  return cudaGetErrorString(e);
}
template <class E>
const char* ck_message(E) {
  return "";
}

#define CK(x)                                                                                   \
  do {                                                                                          \
    const auto e_ = (x);                                                                        \
    if (static_cast<int>(e_) != 0) {                                                            \
      std::printf("error %d %s (%s line %d)\n", static_cast<int>(e_), ck_message(e_), __FILE__, \
                  __LINE__);                                                                    \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)
