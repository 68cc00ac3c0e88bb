// Hugging Face interchange: `moe-train export` turns a checkpoint into a directory transformers
// can load (model.safetensors, config.json, generation_config.json, tokenizer files), and
// model.init_from starts training from such weights (one file, a directory, or a directory of
// shards with model.safetensors.index.json). Both directions check names and shapes against the
// model's parameter table, so a mismatch names the file and the tensor instead of loading garbage.
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_internal.hpp"

namespace moe {
namespace fs = std::filesystem;
using namespace checkpoint_internal;

namespace {

// transformers fills the rest from config.json; token ids are left out because this trainer's
// tokenizer description does not promise them.
std::string generation_config_json() {
  nlohmann::ordered_json j;
  j["_from_model_config"] = true;
  return j.dump(2) + "\n";
}

nlohmann::json read_json(const std::string& path) {
  try {
    return nlohmann::json::parse(read_text_file(path));
  } catch (const nlohmann::json::parse_error& e) {
    throw InputError(path + ": not valid JSON (" + e.what() + ")");
  }
}

// weight_map of a shard index: tensor name -> shard file, grouped by shard (sorted by file).
std::map<std::string, std::vector<std::string>> shard_index(const std::string& index_path) {
  const nlohmann::json index = read_json(index_path);
  auto map = index.is_object() ? index.find("weight_map") : index.end();
  if (!index.is_object() || map == index.end() || !map->is_object())
    throw InputError(index_path + ": no \"weight_map\" object");
  std::map<std::string, std::vector<std::string>> by_shard;
  for (const auto& item : map->items()) {
    if (!item.value().is_string())
      throw InputError(index_path + ": weight_map entry \"" + item.key() + "\" is not a file name");
    by_shard[item.value().get<std::string>()].push_back(item.key());
  }
  return by_shard;
}

// The tensors the index assigns to each shard (a tensor a shard holds but the index does not
// list is not loaded, as in transformers).
void load_sharded(Model& model, const fs::path& index_path) {
  std::vector<NamedTensor> tensors;
  std::vector<std::string> files;
  for (const auto& [shard, names] : shard_index(index_path.string())) {
    const std::string shard_path = (index_path.parent_path() / shard).string();
    std::vector<NamedTensor> held = read_safetensors(shard_path);
    for (const std::string& name : names) {
      auto it = std::find_if(held.begin(), held.end(),
                             [&name](const NamedTensor& t) { return t.name == name; });
      if (it == held.end())
        throw InputError(shard_path + ": tensor " + name + " is missing (" +
                         index_path.filename().string() + " places it in this shard)");
      tensors.push_back(std::move(*it));
      files.push_back(shard_path);
    }
  }
  load_named_tensors_from(model, tensors, files, index_path.string());
}

void load_single(Model& model, const std::string& path) {
  load_named_tensors(model, read_safetensors(path), path);
}

}  // namespace

void export_hf(const std::string& checkpoint, const std::string& out_dir) {
  if (out_dir.empty()) throw InputError("export: the output directory name is empty");
  // Warnings about skipped incomplete checkpoints go to the user directly: export has no log.
  const std::string step_dir = find_latest_checkpoint(checkpoint, &std::cerr);
  if (step_dir.empty())
    throw InputError(checkpoint + ": no complete checkpoint (step_NNNNNNNN/ with DONE) found");
  const Config cfg = load_checkpoint_config(step_dir);
  const std::string weights = (fs::path(step_dir) / "model.safetensors").string();
  const std::vector<NamedTensor> tensors = read_checkpoint_weights(step_dir);
  match_named_tensors(build_param_table(cfg.model), tensors,
                      std::vector<std::string>(tensors.size(), weights), weights);

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw InputError(out_dir + ": cannot create directory: " + ec.message());
  const fs::path out(out_dir);
  write_safetensors((out / "model.safetensors").string(), tensors, hf_weights_metadata());
  write_file_durably((out / "config.json").string(), hf_config_json(cfg.model), nullptr);
  write_file_durably((out / "generation_config.json").string(), generation_config_json(), nullptr);
  if (fs::is_regular_file(fs::path(step_dir) / "moe_tokenizer.json", ec))
    copy_tokenizer_files(step_dir, out_dir, nullptr);
  fsync_directory(out_dir);
}

std::string find_hf_weights(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw InputError(path +
                     ": no such file or directory (model.init_from names a Hugging Face "
                     "directory with model.safetensors or its index, or one .safetensors "
                     "file)");
  if (!fs::is_directory(path, ec)) return path;
  const fs::path dir(path);
  for (const char* name : {"model.safetensors.index.json", "model.safetensors"})
    if (fs::exists(dir / name, ec)) return (dir / name).string();
  throw InputError(path +
                   ": no model.safetensors or model.safetensors.index.json in this directory "
                   "(model.init_from)");
}

void init_from_hf(Model& model, const std::string& path) {
  const std::string file = find_hf_weights(path);
  // A directory's index (a file named as one is read as a .safetensors file and refused).
  if (file != path && fs::path(file).filename() == "model.safetensors.index.json")
    return load_sharded(model, file);
  load_single(model, file);
}

}  // namespace moe
