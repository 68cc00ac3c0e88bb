// AdamW::Overlap: the state of the update behind the next forward (adamw_overlap.cpp), here so
// that adamw.cpp, which owns it, sees the whole type.
#pragma once
#include <vector>

#include "moe/cuda_runtime.hpp"
#include "moe/optim.hpp"

namespace moe {

struct AdamW::Overlap {
  std::vector<size_t> bounds;  // param_unit_bounds: unit starts, then P
  void* side = nullptr;        // gpu::side_stream
  void* fork = nullptr;        // ctx's work before the step (the gradient norm)
  std::vector<void*> ready;    // per unit: its update queued; the last one also the zeroing
  ~Overlap() {
    gpu::event_destroy(fork);
    for (void* e : ready) gpu::event_destroy(e);
  }
};

}  // namespace moe
