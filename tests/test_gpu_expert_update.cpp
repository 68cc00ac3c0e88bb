// The routed experts' AdamW update inside the backward (train.fuse_expert_update): a split-master
// bf16 run without clipping, one micro-batch a step, gives the losses, evaluation and checkpoint
// files of the run that updates them after the backward, bit for bit, with the update behind
// the next forward or in line; its logged gradient norm (the experts' part summed in the dw
// kernels, per warp) agrees to the printed digits; the startup log says which runs fuse, and a
// run with gradient accumulation or clipping does not.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "moe/trainer.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;
namespace fs = std::filesystem;

namespace {

const char* const kFusedLine = "the routed experts' AdamW inside the backward";

Config expert_update_run(const std::string& out_dir, bool fuse, bool overlap) {
  std::vector<std::string> sets = small_model_overrides();
  sets.insert(sets.end(), {"optimizer.params.weight_decay=0.1", "train.max_steps=6",
                           "train.log_interval=2", "train.eval_interval=3", "train.eval_batches=1",
                           "train.save_interval=3", "bf16.enabled=true", "gradient_clipping=0"});
  Config c = parse_config("{}", sets, "test");
  c.train.device = "cuda";
  c.train.out_dir = out_dir;
  c.train.split_master = true;
  c.train.fuse_expert_update = fuse;
  c.train.overlap_optimizer = overlap;
  return c;
}

std::vector<double> logged_grad_norms(const std::string& log) {
  std::vector<double> norms;
  const std::regex re("grad_norm ([0-9.]+)");
  for (std::sregex_iterator it(log.begin(), log.end(), re), end; it != end; ++it)
    norms.push_back(std::stod((*it)[1].str()));
  return norms;
}

}  // namespace

TEST_CASE("gpu train: the experts' update in the backward is the update after it, bitwise",
          "[gpu][train][optim]") {
  for (const bool overlap : {true, false}) {
    INFO("overlap_optimizer " << overlap);
    TempDir plain_dir;
    std::ostringstream plain_log;
    const TrainResult plain =
        train(expert_update_run(plain_dir.path.string(), false, overlap), plain_log);
    CHECK(plain_log.str().find(kFusedLine) == std::string::npos);
    REQUIRE(plain.losses.size() == 6);
    TempDir dir;
    std::ostringstream log;
    const TrainResult fused = train(expert_update_run(dir.path.string(), true, overlap), log);
    INFO(log.str());
    CHECK(log.str().find(kFusedLine) != std::string::npos);
    CHECK(fused.losses == plain.losses);
    CHECK(fused.eval_loss == plain.eval_loss);
    for (const char* step : {"step_00000003", "step_00000006"}) {
      INFO(step);
      CHECK(checkpoint_files(dir.path / step) == checkpoint_files(plain_dir.path / step));
    }
    const std::vector<double> norms = logged_grad_norms(log.str()),
                              plain_norms = logged_grad_norms(plain_log.str());
    REQUIRE(norms.size() == 3);
    REQUIRE(plain_norms.size() == norms.size());
    for (size_t i = 0; i < norms.size(); ++i) {
      CHECK(norms[i] > 0);
      CHECK(std::abs(norms[i] - plain_norms[i]) <= 0.0015);
    }
  }
}

TEST_CASE("gpu train: accumulation or clipping keeps the experts' update after the backward",
          "[gpu][train][optim]") {
  for (const char* set : {"gradient_accumulation_steps=2", "gradient_clipping=1.0"}) {
    INFO(set);
    TempDir dir;
    std::vector<std::string> sets = small_model_overrides();
    sets.insert(sets.end(), {"train.max_steps=2", "bf16.enabled=true", "gradient_clipping=0", set});
    Config c = parse_config("{}", sets, "test");
    c.train.device = "cuda";
    c.train.out_dir = dir.path.string();
    c.train.split_master = true;
    c.train.fuse_expert_update = true;
    std::ostringstream log;
    const TrainResult r = train(c, log);
    CHECK(r.losses.size() == 2);
    CHECK(log.str().find(kFusedLine) == std::string::npos);
  }
}
