// Checkpoints, Hugging Face safetensors and export.
//
// A run directory (train.out_dir) holds step_NNNNNNNN/ directories. Each holds:
//   model.safetensors     the weights under MODEL_SPEC's Hugging Face Mixtral names (experts
//                         expanded: experts.{j}.w1.weight for each j), dtype of the model (F32)
//   config.json           MixtralConfig names + MODEL_SPEC's extra keys
//   trainer_config.json   the trainer's full resolved config
//   rank_NNNNN.state      one per data-parallel rank: magic + version header (with the world
//                         size and ZeRO stage), then step, RNG state, data position, loss
//                         scale, router biases, AdamW step, the AdamW moments of the parameter
//                         ranges this rank holds (ZeRO 1/2: its shard; unsharded: all, in rank
//                         0's file), and (rank 0 only) the fp32 master weights
//   moe_tokenizer.json (+ tokenizer.model) when the run has a tokenizer
//   DONE                  written last: a directory without it is incomplete and never loaded
// Writes go to step_NNNNNNNN.tmp/ (each file fsync'ed; with several ranks every rank writes its
// state file there, then a barrier), which rank 0 renames into place, then DONE is written and
// fsync'ed with its directory. A checkpoint written by N ranks loads on any number of ranks. The
// previous checkpoints are not touched until the new one is complete; then all but the newest
// `keep_last` complete ones are removed.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moe/comm.hpp"
#include "moe/config.hpp"
#include "moe/model.hpp"
#include "moe/optim.hpp"
#include "moe/shards.hpp"

namespace moe {

constexpr uint32_t kStateMagic = 0x4D4F4543;  // "MOEC"
constexpr uint32_t kStateVersion =
    4;  // 2: fp16 loss scaler; 3: sharded moments; 4: the whole scaler state

// Everything besides model and optimizer that an exact resume needs.
struct TrainerState {
  int64_t step = 0;         // optimizer steps completed
  uint64_t rng_state = 0;   // the training data RNG (synthetic source)
  LoaderPosition data;      // the shard loader (token shards)
  double loss_scale = 1.0;  // fp16 loss scale (1 otherwise) and the rest of its scaler
  int64_t loss_scale_hysteresis = 1, loss_scale_iteration = 0, loss_scale_last_overflow = -1;
  int64_t tokens_seen = 0;
};

// ---- safetensors --------------------------------------------------------------------------------
struct NamedTensor {
  std::string name;
  std::string dtype;  // "F32", "F64", "BF16", "F16", "I32"
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
// Header JSON (8-byte little-endian length, then JSON with data_offsets, padded with spaces to a
// multiple of 8), then the raw data. `metadata` goes to "__metadata__".
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::vector<std::pair<std::string, std::string>>& metadata = {});
// Throws InputError naming the file when it is missing, truncated or malformed.
std::vector<NamedTensor> read_safetensors(const std::string& path);

// The model's parameters under their Hugging Face names (expert stacks expanded), and back.
std::vector<NamedTensor> model_to_named_tensors(const Model& model);
// Loads weights by name into the model; throws InputError naming `source` and the tensor on a
// missing name, a shape mismatch or an unknown extra tensor. Converts F32/F64/BF16/F16.
void load_named_tensors(Model& model, const std::vector<NamedTensor>& tensors,
                        const std::string& source);

// Hugging Face config.json for the model (MixtralConfig names + extras), and back (the keys go
// through the config validation; InputError naming the file on bad JSON or values).
std::string hf_config_json(const ModelConfig& m);
ModelConfig model_config_from_hf_json(const std::string& path);

// ---- checkpoints --------------------------------------------------------------------------------
// Test hook: called with (file path, bytes written so far) during writes; may throw to simulate
// a crash or a full disk partway through.
using WriteHook = std::function<void(const std::string& path, size_t bytes)>;

struct SaveOptions {
  std::string run_dir;
  int keep_last = 3;
  std::string tokenizer_dir;  // copied into the checkpoint when non-empty
  int rank = 0, world = 1;
  int zero_stage = 0;    // recorded in the state files' headers
  Comm* comm = nullptr;  // required when world > 1 (barriers around the shared tmp directory)
  WriteHook hook;        // tests only
};
// Returns the step directory written.
std::string save_checkpoint(const SaveOptions& opt, const Config& cfg, const Model& model,
                            const AdamW& optimizer, const TrainerState& state);

// The newest complete step directory of `run_dir` (or `run_dir` itself when it is a complete step
// directory); "" when none. Incomplete ones (no DONE) are skipped with a warning to `warn`. Where
// a crash interrupted a save that replaced a complete step_N, that copy is found as
// step_N.replaced while step_N is incomplete or missing.
std::string find_latest_checkpoint(const std::string& run_dir, std::ostream* warn);

// Restores model, optimizer and trainer state from a step directory, whatever the number of
// ranks that wrote it: the optimizer's partition() says which moments this rank takes. Throws
// InputError naming the file when it is corrupt or was written for another model shape.
void load_checkpoint(const std::string& step_dir, int rank, Model& model, AdamW& optimizer,
                     TrainerState& state);
// The trainer config stored in a step directory (for eval / sample / export).
Config load_checkpoint_config(const std::string& step_dir);
// The weights, and the aux-loss-free router biases when the model uses them (eval, sample).
// InputError naming model.safetensors when its size or checksum is not what DONE recorded at the
// save (nothing to check in a checkpoint saved before DONE recorded them), or naming the first
// tensor that holds a NaN or Inf.
void load_checkpoint_weights(const std::string& step_dir, Model& model);

// `moe-train export`: a Hugging Face directory (model.safetensors, config.json, tokenizer files,
// generation_config.json).
void export_hf(const std::string& checkpoint, const std::string& out_dir);
// model.init_from: weights from a HF Mixtral directory (model.safetensors or sharded
// model-*.safetensors with an index) or a single .safetensors file.
void init_from_hf(Model& model, const std::string& path);
// The file init_from_hf reads first for `path`: the .safetensors file, or the directory's
// model.safetensors.index.json or model.safetensors. An InputError naming `path` and
// model.init_from when there is none; `moe-train train` calls it before the model is built.
std::string find_hf_weights(const std::string& path);

}  // namespace moe
