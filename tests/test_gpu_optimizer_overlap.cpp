// AdamW behind the next forward (train.overlap_optimizer, AdamW::overlap_forward) on the GPU: a
// training run with the update overlapped gives the in-line run's losses, evaluation and
// checkpoint files bit for bit, with a split master, a plain bf16 master and fp16 with loss
// scaling (steps skipped on overflow included), and without clipping (the gradient norm then from
// the update on the side stream, read at log steps), over accumulated micro-batches, evaluations
// and saves between steps, and says so in its log.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "gpu_test_util.hpp"
#include "moe/cuda_runtime.hpp"
#include "moe/trainer.hpp"
#include "test_util.hpp"

using namespace moe;
using namespace moe::test;
namespace fs = std::filesystem;

namespace {

// precision: bf16-split, bf16, fp16, or bf16-split-noclip (no clipping: the norm from the update,
// read at the log steps, every second one).
Config overlap_run(const std::string& out_dir, const std::string& precision, bool overlap) {
  std::vector<std::string> sets = small_model_overrides();
  sets.insert(sets.end(), {"optimizer.params.weight_decay=0.1", "train.max_steps=6",
                           "train.log_interval=10", "train.eval_interval=2", "train.eval_batches=1",
                           "train.save_interval=3", "gradient_accumulation_steps=2"});
  if (precision == "fp16") {
    sets.push_back("fp16.enabled=true");
    // 2^24 over 128 tokens: the logits' gradient overflows fp16 in the first steps, which are
    // skipped while the scale halves (hysteresis 1), and the later ones update
    sets.push_back("fp16.initial_scale_power=24");
    sets.push_back("fp16.hysteresis=1");
  } else {
    sets.push_back("bf16.enabled=true");
  }
  Config c = parse_config("{}", sets, "test");
  c.train.device = "cuda";
  c.train.out_dir = out_dir;
  c.train.split_master = precision.rfind("bf16-split", 0) == 0;
  if (precision == "bf16-split-noclip") {
    c.gradient_clipping = 0;
    c.train.log_interval = 2;
  }
  c.train.overlap_optimizer = overlap;
  return c;
}

}  // namespace

TEST_CASE("gpu train: the update overlapped with the next forward is the in-line run's, bitwise",
          "[gpu][train][optim]") {
  for (const std::string precision : {"bf16-split", "bf16", "fp16", "bf16-split-noclip"}) {
    TempDir inline_dir;
    std::ostringstream inline_log;
    const TrainResult in_line =
        train(overlap_run(inline_dir.path.string(), precision, false), inline_log);
    CHECK(inline_log.str().find("behind the next forward") == std::string::npos);
    REQUIRE(in_line.losses.size() == 6);
    if (precision == "fp16") CHECK(in_line.skipped_steps > 0);
    INFO(precision);
    TempDir dir;
    std::ostringstream log;
    const TrainResult over = train(overlap_run(dir.path.string(), precision, true), log);
    INFO(log.str());
    CHECK(log.str().find("behind the next forward") != std::string::npos);
    CHECK(over.losses == in_line.losses);
    CHECK(over.skipped_steps == in_line.skipped_steps);
    CHECK(over.eval_loss == in_line.eval_loss);
    for (const char* step : {"step_00000003", "step_00000006"}) {
      INFO(step);
      CHECK(checkpoint_files(dir.path / step) == checkpoint_files(inline_dir.path / step));
    }
  }
}
