#include "train/grad_buckets.hpp"

#include <string>

#include "moe/error.hpp"

namespace moe {

GradientBuckets::GradientBuckets(size_t total, size_t bucket_elems, Launch launch)
    : total_(total),
      bucket_elems_(bucket_elems > 0 ? bucket_elems : 1),
      launch_(std::move(launch)),
      lo_(total),
      hi_(total) {}

void GradientBuckets::ready(size_t begin, size_t end) {
  MOE_CHECK(end == lo_ && begin <= end,
            "GradientBuckets: range [" + std::to_string(begin) + ", " + std::to_string(end) +
                ") does not adjoin the previous one (expected it to end at " + std::to_string(lo_) +
                ")");
  lo_ = begin;
  if (hi_ - lo_ >= bucket_elems_) {
    launch_(lo_, hi_);
    hi_ = lo_;
  }
}

void GradientBuckets::flush() {
  MOE_CHECK(lo_ == 0, "GradientBuckets: the backward reported gradients down to " +
                          std::to_string(lo_) + ", not the whole buffer");
  if (hi_ > lo_) launch_(lo_, hi_);
  lo_ = hi_ = total_;
}

}  // namespace moe
