// The CUDA runtime layer: device discovery, the compiled-arch check, device buffers and host
// copies in every storage dtype, and the per-device stream and cuBLAS handle.
#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gpu_test_util.hpp"

using namespace moe;
using namespace moe::test;

TEST_CASE("gpu runtime: device info and code for it", "[gpu]") {
  REQUIRE(gpu::device_count() >= 1);
  gpu::DeviceInfo info = gpu::device_info(0);
  INFO(info.name << " sm_" << info.major << info.minor);
  CHECK(info.major >= 7);
  CHECK(info.total_bytes > info.free_bytes);
  std::string why;
  CHECK(gpu::has_code_for(0, &why));
  // The code it runs is one the build lists (MOE_CUDA_ARCHS: "75,80,90", "75-virtual", ...) and
  // not newer than the device.
  const int arch = gpu::code_arch(0);
  INFO("code arch " << arch << ", built for " << MOE_CUDA_ARCHS_STR);
  CHECK(arch >= 75);
  CHECK(arch <= info.major * 10 + info.minor);
  std::vector<int> listed;
  std::istringstream archs(MOE_CUDA_ARCHS_STR);
  for (std::string entry; std::getline(archs, entry, ',');)
    listed.push_back(std::stoi(entry));  // "90-real" -> 90
  CHECK(std::find(listed.begin(), listed.end(), arch) != listed.end());
}

TEST_CASE("gpu runtime: buffers round-trip every dtype", "[gpu]") {
  std::vector<double> v = {1.0, -2.5, 3.25, 1e-3, -7.0, 65504.0 / 4};
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    DeviceTensor t(dt, {2, 3});
    poison(t);
    upload(t, v);
    CHECK(download(t) == round_to(dt, v));
  }
  DeviceTensor idx(DType::i32, {4});
  upload_i32(idx, {3, -1, 7, 0});
  CHECK(download_i32(idx) == std::vector<int32_t>{3, -1, 7, 0});
  Buffer zeroed(gpu0(), 64);  // new buffers are zero-filled
  std::vector<int32_t> z(16, 5);
  copy_to_host(z.data(), zeroed.as(DType::i32, {16}));
  CHECK(z == std::vector<int32_t>(16, 0));
}

TEST_CASE("gpu runtime: contexts carry a stream and a cuBLAS handle", "[gpu]") {
  Ctx a = gpu_ctx(), b = gpu_ctx();
  CHECK(a.stream != nullptr);
  CHECK(a.blas != nullptr);
  CHECK(a.stream == b.stream);  // one per device, created once
}

TEST_CASE("gpu runtime: out-of-memory names the sizes", "[gpu]") {
  try {
    Buffer huge(gpu0(), size_t{1} << 50);
    FAIL("allocated a petabyte");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()).find("out of GPU memory") != std::string::npos);
  }
}

TEST_CASE("gpu runtime: the memory limit caps allocations and says so", "[gpu]") {
  Buffer first(gpu0(), size_t{1} << 20);
  const size_t held = gpu::allocated_bytes();
  CHECK(held >= size_t{1} << 20);
  CHECK(gpu::peak_allocated_bytes() >= held);
  gpu::set_memory_limit(held + (size_t{1} << 20));  // room for 1 MiB more
  Buffer fits(gpu0(), size_t{1} << 19);
  try {
    Buffer too_big(gpu0(), size_t{1} << 21);
    gpu::set_memory_limit(0);
    FAIL("allocated past the limit");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()).find("--gpu-memory-limit") != std::string::npos);
  }
  gpu::set_memory_limit(0);
  CHECK(gpu::memory_limit() == 0);
  Buffer after(gpu0(), size_t{1} << 21);  // no limit again
  CHECK(after.data() != nullptr);
}
