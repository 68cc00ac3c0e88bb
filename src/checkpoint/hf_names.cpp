// The model in Hugging Face terms: its parameters as named tensors (MODEL_SPEC's Mixtral names,
// each expert stack [E, out, in] expanded to E tensors experts.{j}.*) and back, and config.json
// (MixtralConfig names plus MODEL_SPEC's extra keys) both ways. Loading checks every name, shape
// and dtype before it copies anything, so a wrong file leaves the model untouched.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_internal.hpp"
#include "checkpoint/float_convert.hpp"

namespace moe {
namespace checkpoint_internal {

namespace {

// Host memory per staging copy: bounded however large one parameter is.
constexpr size_t kChunkBytes = size_t{64} << 20;

std::string expand_name(const std::string& name, int member) {
  std::string out = name;
  const size_t at = out.find("{j}");
  if (at != std::string::npos) out.replace(at, 3, std::to_string(member));
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Where one Hugging Face tensor lies in the flat parameter buffer: elements [first, second).
std::pair<size_t, size_t> hf_tensor_range(const Model& model, const HfTensor& h) {
  const ParamInfo& p = model.table().params[h.param];
  const size_t member = p.numel() / static_cast<size_t>(p.stack);
  const size_t begin = p.offset + static_cast<size_t>(h.member) * member;
  return {begin, begin + member};
}

// The whole tensor as a 1-D view, so it can be cut into row ranges of any length.
Tensor flat(const Tensor& t) {
  Tensor f = t;
  f.ndim = 1;
  f.shape = {};
  f.shape[0] = t.numel();
  return f;
}

bool is_float_dtype(const std::string& d) {
  return d == "F32" || d == "F64" || d == "BF16" || d == "F16";
}

double read_element(const uint8_t* p, const std::string& dtype) {
  if (dtype == "F32") {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  }
  if (dtype == "F64") {
    double v;
    std::memcpy(&v, p, 8);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return dtype == "BF16" ? bf16_to_float(h) : f16_to_float(h);
}

void write_element(uint8_t* p, DType t, double v) {
  switch (t) {
    case DType::f64:
      std::memcpy(p, &v, 8);
      return;
    case DType::f32: {
      float f = static_cast<float>(v);
      std::memcpy(p, &f, 4);
      return;
    }
    case DType::bf16:
    case DType::f16: {
      const float f = static_cast<float>(v);
      const uint16_t h = t == DType::bf16 ? float_to_bf16(f) : float_to_f16(f);
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::i32:
    case DType::u16:
      break;
  }
  throw InternalError("load_named_tensors: the model's dtype is not a float type");
}

// The tensor's bytes in the model's dtype: the stored bytes themselves when the dtypes agree, so
// an F32 round trip is bitwise (NaN payloads included).
std::vector<uint8_t> converted_bytes(const NamedTensor& t, DType to) {
  if (t.dtype == safetensors_dtype(to)) return t.bytes;
  const size_t in_size = safetensors_dtype_size(t.dtype), out_size = dtype_size(to);
  const size_t n = t.bytes.size() / in_size;
  std::vector<uint8_t> out(n * out_size);
  for (size_t i = 0; i < n; ++i)
    write_element(out.data() + i * out_size, to,
                  read_element(t.bytes.data() + i * in_size, t.dtype));
  return out;
}

// Hugging Face sometimes saves lm_head.weight for a tied model anyway: a copy of the embedding,
// safe to skip. A different one would be silently lost, so only an exact copy is skipped.
bool is_tied_copy(const std::vector<NamedTensor>& tensors, const NamedTensor& head) {
  for (const auto& t : tensors)
    if (t.name == "model.embed_tokens.weight")
      return t.dtype == head.dtype && t.shape == head.shape && t.bytes == head.bytes;
  return false;
}

}  // namespace

Metadata hf_weights_metadata() {
  return {{"format", "pt"}};
}

std::string safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
    case DType::f16:
      return "F16";
    case DType::bf16:
      return "BF16";
    case DType::i32:
      return "I32";
    case DType::u16:
      return "U16";
  }
  return "?";
}

size_t first_non_finite(const uint8_t* p, size_t n, const std::string& dtype) {
  if (dtype == "F32") {  // (the master weights' dtype: the loop a save runs over every weight)
    // Whether any element has the all-ones exponent of a NaN or Inf, in a loop without an exit
    // (vectorised); where, only then, by the general loop below.
    bool any = false;
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, p + 4 * i, 4);
      any |= (bits & 0x7f800000u) == 0x7f800000u;
    }
    if (!any) return n;
  }
  const size_t size = safetensors_dtype_size(dtype);
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(read_element(p + i * size, dtype))) return i;
  return n;
}

std::string non_finite_message(const std::string& tensor, size_t at) {
  return tensor + " holds a non-finite value (NaN or Inf) at element " + std::to_string(at);
}

void require_finite_tensors(const std::vector<NamedTensor>& tensors, const std::string& path) {
  for (const NamedTensor& t : tensors) {
    if (!is_float_dtype(t.dtype)) continue;  // (match_named_tensors names a wrong dtype)
    const size_t n = t.bytes.size() / safetensors_dtype_size(t.dtype);
    const size_t at = first_non_finite(t.bytes.data(), n, t.dtype);
    if (at < n)
      throw InputError(path + ": " + non_finite_message(t.name, at) +
                       ": the run that saved these weights had diverged; use an earlier "
                       "checkpoint");
  }
}

std::vector<HfTensor> hf_tensors(const ParamTable& table) {
  std::vector<HfTensor> out;
  for (size_t i = 0; i < table.params.size(); ++i) {
    const ParamInfo& p = table.params[i];
    for (int j = 0; j < p.stack; ++j) out.push_back({expand_name(p.name, j), p.shape, i, j});
  }
  return out;
}

namespace {

// fn(b, e, staging) over [begin, end) in runs of at most chunk_bytes / elem elements (at least
// one), with one staging buffer of that many elements of `elem` bytes for all of them.
template <class Fn>
void in_chunks(size_t begin, size_t end, size_t elem, size_t chunk_bytes, Fn&& fn) {
  const size_t step = std::max<size_t>(1, chunk_bytes / elem);
  std::vector<uint8_t> staging(std::min(end - begin, step) * elem);
  for (size_t b = begin; b < end; b += step) fn(b, std::min(end, b + step), staging.data());
}

Tensor flat_rows(const Tensor& f, size_t b, size_t e) {
  return f.rows(static_cast<int64_t>(b), static_cast<int64_t>(e));
}

}  // namespace

void tensor_to_host_chunks(const Tensor& t, size_t chunk_bytes,
                           const std::function<void(const void*, size_t)>& sink) {
  const Tensor f = flat(t);
  in_chunks(0, static_cast<size_t>(f.numel()), dtype_size(f.dtype), chunk_bytes,
            [&](size_t b, size_t e, uint8_t* staging) {
              const Tensor part = flat_rows(f, b, e);
              copy_to_host(staging, part);
              sink(staging, part.nbytes());
            });
}

void master_to_host_chunks(const Model& model, size_t begin, size_t end, size_t chunk_bytes,
                           const std::function<void(const void*, size_t)>& sink) {
  const size_t elem = dtype_size(model.dtype());
  in_chunks(begin, end, elem, chunk_bytes, [&](size_t b, size_t e, uint8_t* staging) {
    model.master_to_host(b, e, staging);
    sink(staging, (e - b) * elem);
  });
}

void master_from_host_chunks(Model& model, size_t begin, size_t end, size_t chunk_bytes,
                             const std::function<void(void*, size_t)>& source) {
  const size_t elem = dtype_size(model.dtype());
  in_chunks(begin, end, elem, chunk_bytes, [&](size_t b, size_t e, uint8_t* staging) {
    source(staging, (e - b) * elem);
    model.master_from_host(b, e, staging);
  });
}

void tensor_from_host_chunks(const Tensor& t, size_t chunk_bytes,
                             const std::function<void(void*, size_t)>& source) {
  const Tensor f = flat(t);
  in_chunks(0, static_cast<size_t>(f.numel()), dtype_size(f.dtype), chunk_bytes,
            [&](size_t b, size_t e, uint8_t* staging) {
              const Tensor part = flat_rows(f, b, e);
              source(staging, part.nbytes());
              copy_from_host(part, staging);
            });
}

std::vector<SafetensorsEntry> model_safetensors_entries(const Model& model) {
  std::vector<SafetensorsEntry> entries;
  const std::string dtype = safetensors_dtype(model.dtype());
  for (const HfTensor& h : hf_tensors(model.table())) {
    const auto [begin, end] = hf_tensor_range(model, h);
    const size_t elem = dtype_size(model.dtype());
    SafetensorsEntry e{h.name, dtype, h.shape, (end - begin) * elem, nullptr};
    // A weight that is not finite stops the save (NonFiniteError) before the file is complete:
    // the checkpoint is never published, so retention keeps the earlier ones.
    e.write_data = [&model, begin = begin, end = end, elem, dtype, name = h.name](DurableFile& f) {
      size_t done = 0;
      master_to_host_chunks(model, begin, end, kChunkBytes, [&](const void* p, size_t n) {
        const size_t count = n / elem;
        const size_t at = first_non_finite(static_cast<const uint8_t*>(p), count, dtype);
        if (at < count) throw NonFiniteError(non_finite_message(name, done + at));
        done += count;
        f.write(p, n);
      });
    };
    entries.push_back(std::move(e));
  }
  return entries;
}

std::vector<int> match_named_tensors(const ParamTable& table,
                                     const std::vector<NamedTensor>& tensors,
                                     const std::vector<std::string>& files,
                                     const std::string& source) {
  const std::vector<HfTensor> expected = hf_tensors(table);
  std::unordered_map<std::string, int> index;
  for (size_t i = 0; i < expected.size(); ++i) index[expected[i].name] = static_cast<int>(i);
  const bool tied = index.count("lm_head.weight") == 0;
  std::vector<int> match(tensors.size(), -1);
  std::vector<bool> seen(expected.size(), false);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const NamedTensor& t = tensors[i];
    const std::string where = files[i] + ": tensor " + t.name;
    auto it = index.find(t.name);
    if (it == index.end()) {
      if (tied && t.name == "lm_head.weight" && is_tied_copy(tensors, t)) continue;
      if (tied && t.name == "lm_head.weight")
        throw InputError(where +
                         " differs from model.embed_tokens.weight, but this model ties "
                         "them (tie_word_embeddings): the file is from an untied model");
      throw InputError(where + " is not a parameter of this model (different architecture?)");
    }
    const HfTensor& h = expected[it->second];
    if (seen[it->second]) throw InputError(where + " appears twice");
    if (t.shape != h.shape)
      throw InputError(where + " has shape " + shape_text(t.shape) + ", the model expects " +
                       shape_text(h.shape));
    if (!is_float_dtype(t.dtype))
      throw InputError(where + " has dtype " + t.dtype + "; weights must be F32, F64, BF16 or F16");
    seen[it->second] = true;
    match[i] = it->second;
  }
  for (size_t i = 0; i < expected.size(); ++i)
    if (!seen[i])
      throw InputError(source + ": tensor " + expected[i].name + " " +
                       shape_text(expected[i].shape) + " is missing");
  return match;
}

void load_named_tensors_from(Model& model, const std::vector<NamedTensor>& tensors,
                             const std::vector<std::string>& files, const std::string& source) {
  const std::vector<int> match = match_named_tensors(model.table(), tensors, files, source);
  const std::vector<HfTensor> expected = hf_tensors(model.table());
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (match[i] < 0) continue;
    const std::vector<uint8_t> bytes = converted_bytes(tensors[i], model.dtype());
    const auto [begin, end] = hf_tensor_range(model, expected[match[i]]);
    model.master_from_host(begin, end, bytes.data());
  }
  Ctx ctx = make_ctx(model.device());
  model.weights_changed(ctx);
}

}  // namespace checkpoint_internal

using namespace checkpoint_internal;

std::vector<NamedTensor> model_to_named_tensors(const Model& model) {
  std::vector<NamedTensor> out;
  const std::string dtype = safetensors_dtype(model.dtype());
  for (const HfTensor& h : hf_tensors(model.table())) {
    const auto [begin, end] = hf_tensor_range(model, h);
    NamedTensor t{h.name, dtype, h.shape,
                  std::vector<uint8_t>((end - begin) * dtype_size(model.dtype()))};
    model.master_to_host(begin, end, t.bytes.data());
    out.push_back(std::move(t));
  }
  return out;
}

void load_named_tensors(Model& model, const std::vector<NamedTensor>& tensors,
                        const std::string& source) {
  load_named_tensors_from(model, tensors, std::vector<std::string>(tensors.size(), source), source);
}

// ---- config.json

namespace {

// MixtralConfig's defaults, for keys a Hugging Face config.json leaves out.
nlohmann::json mixtral_defaults() {
  return {{"vocab_size", 32000},
          {"hidden_size", 4096},
          {"intermediate_size", 14336},
          {"num_hidden_layers", 32},
          {"num_attention_heads", 32},
          {"num_key_value_heads", 8},
          {"max_position_embeddings", 131072},
          {"initializer_range", 0.02},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 1e6},
          {"num_experts_per_tok", 2},
          {"num_local_experts", 8},
          {"router_aux_loss_coef", 0.001},
          {"tie_word_embeddings", false}};
}

// The config.json keys that describe the model; everything else (torch_dtype, hidden_act,
// transformers_version, token ids, ...) says nothing this trainer could use.
constexpr const char* kModelKeys[] = {"model_type",
                                      "architectures",
                                      "vocab_size",
                                      "hidden_size",
                                      "intermediate_size",
                                      "num_hidden_layers",
                                      "num_attention_heads",
                                      "num_key_value_heads",
                                      "head_dim",
                                      "rms_norm_eps",
                                      "rope_theta",
                                      "max_position_embeddings",
                                      "num_local_experts",
                                      "num_experts_per_tok",
                                      "router_aux_loss_coef",
                                      "router_z_loss_coef",
                                      "router_bias_update_rate",
                                      "tie_word_embeddings",
                                      "moe_layer_freq",
                                      "dense_intermediate_size",
                                      "norm_topk_prob",
                                      "num_shared_experts",
                                      "shared_expert_intermediate_size",
                                      "initializer_range",
                                      "mod"};

nlohmann::json parse_json_file(const std::string& path) {
  const std::string text = read_text_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw InputError(path + ": not valid JSON (" + e.what() + ")");
  }
}

}  // namespace

std::string hf_config_json(const ModelConfig& m) {
  nlohmann::ordered_json j;
  j["architectures"] = {"MixtralForCausalLM"};
  j["model_type"] = "mixtral";
  j["vocab_size"] = m.vocab_size;
  j["hidden_size"] = m.hidden_size;
  j["intermediate_size"] = m.intermediate_size;
  j["num_hidden_layers"] = m.num_hidden_layers;
  j["num_attention_heads"] = m.num_attention_heads;
  j["num_key_value_heads"] = m.num_key_value_heads;
  j["head_dim"] = m.resolved_head_dim();
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = m.max_position_embeddings;
  j["initializer_range"] = m.initializer_range;
  j["rms_norm_eps"] = m.rms_norm_eps;
  j["rope_theta"] = m.rope_theta;
  j["sliding_window"] = nullptr;
  j["attention_dropout"] = 0.0;
  j["num_local_experts"] = m.num_local_experts;
  j["num_experts_per_tok"] = m.num_experts_per_tok;
  j["router_aux_loss_coef"] = m.router_aux_loss_coef;
  j["output_router_logits"] = false;
  j["tie_word_embeddings"] = m.tie_word_embeddings;
  j["torch_dtype"] = "float32";
  j["use_cache"] = true;
  // MODEL_SPEC's extras: transformers keeps unknown keys as attributes and ignores them.
  j["moe_layer_freq"] = m.moe_layer_freq;
  j["dense_intermediate_size"] = m.resolved_dense_ffn();
  j["norm_topk_prob"] = m.norm_topk_prob;
  j["num_shared_experts"] = m.num_shared_experts;
  j["shared_expert_intermediate_size"] = m.resolved_shared_ffn();
  j["router_z_loss_coef"] = m.router_z_loss_coef;
  j["router_bias_update_rate"] = m.router_bias_update_rate;
  j["mod"] = {{"enabled", m.mod.enabled},
              {"capacity", m.mod.capacity},
              {"every", m.mod.every},
              {"predictor_hidden_size", m.mod.predictor_hidden_size},
              {"predictor_loss_coef", m.mod.predictor_loss_coef}};
  return j.dump(2) + "\n";
}

// The keys go through the trainer's own config parser (as a "model" section), so a config.json
// gets exactly the type, range and consistency checks a config file gets.
ModelConfig model_config_from_hf_json(const std::string& path) {
  const nlohmann::json hf = parse_json_file(path);
  if (!hf.is_object()) throw InputError(path + ": not a JSON object");
  nlohmann::json model = mixtral_defaults();
  for (const char* key : kModelKeys) {
    auto it = hf.find(key);
    if (it != hf.end() && !it->is_null()) model[key] = *it;
  }
  // MixtralConfig: num_key_value_heads null means one kv head per query head (no GQA).
  auto kv = hf.find("num_key_value_heads");
  if (kv != hf.end() && kv->is_null()) model["num_key_value_heads"] = model["num_attention_heads"];
  // The smallest data section every model accepts: only the model is wanted here.
  nlohmann::json doc = {{"model", model},
                        {"data", {{"seq_len", 1}, {"synthetic", {{"branching", 1}}}}}};
  try {
    return parse_config(doc.dump(), {}, path).model;
  } catch (const ConfigError& e) {
    throw InputError(path + ": " + e.what());
  }
}

}  // namespace moe
