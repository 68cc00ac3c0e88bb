// SingleComm: the world of one rank, on any device. Sums over one rank are the input, gathers and
// scatters copy (nothing when in place), barrier returns. On a GPU the copies are enqueued on the
// set stream, as NCCL's would be.
#include "parallel/comm_impl.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/error.hpp"

namespace moe::dist {

namespace {

bool any_dtype(DType, DTypeUse) {
  return true;
}

class SingleComm final : public Comm {
 public:
  SingleComm(const RankInfo& info, Device dev, double timeout_s) : Comm(info, dev, timeout_s) {
    MOE_CHECK(info.world == 1 && info.rank == 0, "SingleComm needs a world of one rank");
  }

  const char* backend() const override { return "single"; }
  void set_stream(void* stream) override { stream_ = stream; }

  void all_reduce_sum(Tensor t) override {
    check_tensor(*this, t, "all_reduce_sum", "inout", any_dtype, DTypeUse::reduce);
  }

  void reduce_sum(Tensor t, int root) override {
    check_tensor(*this, t, "reduce_sum", "inout", any_dtype, DTypeUse::reduce);
    check_root(*this, root, "reduce_sum");
  }

  void reduce_scatter_sum(Tensor out, Tensor in) override {
    const char* op = "reduce_scatter_sum";
    check_tensor(*this, out, op, "out", any_dtype, DTypeUse::reduce);
    check_tensor(*this, in, op, "in", any_dtype, DTypeUse::reduce);
    check_reduce_scatter(*this, out, in, op);
    copy(out, in);
  }

  void all_gather(Tensor out, Tensor in) override {
    const char* op = "all_gather";
    check_tensor(*this, out, op, "out", any_dtype, DTypeUse::move);
    check_tensor(*this, in, op, "in", any_dtype, DTypeUse::move);
    check_all_gather(*this, out, in, op);
    copy(out, in);
  }

  void all_to_all_v(Tensor out, const std::vector<int64_t>& out_counts, Tensor in,
                    const std::vector<int64_t>& in_counts) override {
    const char* op = "all_to_all_v";
    check_tensor(*this, out, op, "out", any_dtype, DTypeUse::move);
    check_tensor(*this, in, op, "in", any_dtype, DTypeUse::move);
    check_all_to_all_v(*this, out, out_counts, in, in_counts, op);
    copy(out, in);
  }

  void broadcast(Tensor t, int root) override {
    check_tensor(*this, t, "broadcast", "t", any_dtype, DTypeUse::move);
    check_root(*this, root, "broadcast");
  }

  void copy_from_host(Tensor dst, const void* src) override {
    check_tensor(*this, dst, "copy_from_host", "dst", any_dtype, DTypeUse::move);
    copy_bytes(device(), dst.data, src, dst.nbytes(), stream());
  }

  void copy_to_host(void* dst, Tensor src) override {
    check_tensor(*this, src, "copy_to_host", "src", any_dtype, DTypeUse::move);
    copy_bytes(device(), dst, src.data, src.nbytes(), stream());
  }

  void after_queued(std::function<void()> fn) override {
    if (device().type == DeviceType::cuda)
      gpu::launch_host_func(stream(), std::move(fn));
    else
      fn();
  }

  void barrier() override {}

 private:
  void* stream() const {
    if (device().type != DeviceType::cuda) return nullptr;
    return stream_ ? stream_ : gpu::default_stream(device().index);
  }
  void copy(const Tensor& dst, const Tensor& src) {
    copy_bytes(device(), dst.data, src.data, src.nbytes(), stream());
  }

  void* stream_ = nullptr;
};

}  // namespace

std::unique_ptr<Comm> make_single_comm(const RankInfo& info, Device dev, double timeout_s) {
  return std::make_unique<SingleComm>(info, dev, timeout_s);
}

}  // namespace moe::dist
