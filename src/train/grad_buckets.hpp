// Gradient buckets for reducing a step's gradients while the backward is still running
// (zero_optimization.overlap_comm).
//
// The model reports each gradient range as its backward finishes it (Model::GradientReady:
// adjacent ranges, from the end of the buffer toward its start). Reducing every layer on its own
// would mean many small collectives, each paying its latency; reducing the whole buffer at the
// end leaves nothing to overlap. So the ranges are gathered into buckets of at least
// `bucket_elems` elements (DeepSpeed's reduce_bucket_size) and each full bucket is launched at
// once; flush() launches the rest after the backward. Every element is in exactly one bucket.
#pragma once
#include <cstddef>
#include <functional>

namespace moe {

class GradientBuckets {
 public:
  // launch(begin, end): reduce gradient elements [begin, end) now.
  using Launch = std::function<void(size_t begin, size_t end)>;
  GradientBuckets(size_t total, size_t bucket_elems, Launch launch);

  // [begin, end) has its final gradient. Must adjoin the previous range from below (the first
  // must end at `total`); anything else is an InternalError (a model that reports out of order).
  void ready(size_t begin, size_t end);
  // Launches the pending bucket, checks that the ranges covered the whole buffer, and starts
  // over for the next step.
  void flush();

 private:
  size_t total_, bucket_elems_;
  Launch launch_;
  size_t lo_, hi_;  // the pending bucket [lo_, hi_); lo_ is also where the next range must end
};

}  // namespace moe
