// Shared between the files of src/checkpoint: the streaming safetensors writer (weights go from
// the model's buffers to disk one tensor at a time, never as a second full copy in host memory),
// the Hugging Face tensor list of a parameter table, and chunked host <-> tensor copies.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/file_io.hpp"
#include "moe/checkpoint.hpp"
#include "moe/model.hpp"

namespace moe::checkpoint_internal {

using Metadata = std::vector<std::pair<std::string, std::string>>;

// ---- safetensors.cpp
// Bytes per element of a safetensors dtype name; 0 when the name is not a safetensors dtype.
size_t safetensors_dtype_size(const std::string& dtype);

// One tensor to write: its header entry and a function that writes exactly `nbytes` data bytes.
struct SafetensorsEntry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  std::function<void(DurableFile&)> write_data;
};
// Writes header and data into `f` (entries sorted by name, offsets in that order); no commit.
void write_safetensors_entries(DurableFile& f, std::vector<SafetensorsEntry> entries,
                               const Metadata& metadata);
// read_safetensors, `sum` taking the file's bytes as they are read (in offset order: the whole
// file where the tensors tile the data section, as write_safetensors_entries lays them out).
std::vector<NamedTensor> read_safetensors_summed(const std::string& path, Checksum& sum);

// ---- hf_names.cpp
// transformers refuses a safetensors file without this metadata ("format": "pt").
Metadata hf_weights_metadata();
std::string safetensors_dtype(DType t);

// One tensor of the Hugging Face layout: parameter `param` of the table, member `member` of its
// stack (0 for unstacked parameters).
struct HfTensor {
  std::string name;
  std::vector<int64_t> shape;
  size_t param = 0;
  int member = 0;
};
std::vector<HfTensor> hf_tensors(const ParamTable& table);
// The index of the first NaN or Inf of the n elements of safetensors dtype `dtype` at p, or n.
size_t first_non_finite(const uint8_t* p, size_t n, const std::string& dtype);
// "NAME holds a non-finite value (NaN or Inf) at element AT"
std::string non_finite_message(const std::string& tensor, size_t at);
// InputError naming `path` and the first tensor with a NaN or Inf element (eval and sample: a
// checkpoint saved before saves refused such weights, named here instead of by the first op
// whose output is not finite, or printed as a NaN loss).
void require_finite_tensors(const std::vector<NamedTensor>& tensors, const std::string& path);

// The model's weights as streaming entries (for model.safetensors inside a checkpoint); the
// writes throw NonFiniteError naming the first weight that holds a NaN or Inf.
std::vector<SafetensorsEntry> model_safetensors_entries(const Model& model);

// Checks `tensors` against the table: every name present once, shapes equal, float dtypes. For
// tensor i, files[i] names the file it came from; `source` names the whole set (for a missing
// tensor). Returns, per tensor, its index in hf_tensors(table), or -1 for a tensor that is
// deliberately ignored (lm_head.weight of a model with tied embeddings). Throws InputError.
std::vector<int> match_named_tensors(const ParamTable& table,
                                     const std::vector<NamedTensor>& tensors,
                                     const std::vector<std::string>& files,
                                     const std::string& source);
// match_named_tensors, then the copy into the model (converting to its dtype).
void load_named_tensors_from(Model& model, const std::vector<NamedTensor>& tensors,
                             const std::vector<std::string>& files, const std::string& source);

// Chunked copies between a tensor (any device) and the host, in pieces of at most `chunk_bytes`
// so a large tensor never needs a full host-side copy.
void tensor_to_host_chunks(const Tensor& t, size_t chunk_bytes,
                           const std::function<void(const void*, size_t)>& sink);
void tensor_from_host_chunks(const Tensor& t, size_t chunk_bytes,
                             const std::function<void(void*, size_t)>& source);
// The same for the model's master weights [begin, end) (Model::master_to_host /
// master_from_host: exact also for a split master); the caller then calls weights_changed.
void master_to_host_chunks(const Model& model, size_t begin, size_t end, size_t chunk_bytes,
                           const std::function<void(const void*, size_t)>& sink);
void master_from_host_chunks(Model& model, size_t begin, size_t end, size_t chunk_bytes,
                             const std::function<void(void*, size_t)>& source);

// ---- checkpoint.cpp
// model.safetensors of a complete step directory, read once and checked against the size and
// checksum DONE recorded at the save (InputError naming the file otherwise; a DONE from before
// the record: read unchecked).
std::vector<NamedTensor> read_checkpoint_weights(const std::string& step_dir);
// Copies moe_tokenizer.json (required) and tokenizer.model (when present) from one directory to
// another, durably.
void copy_tokenizer_files(const std::string& from_dir, const std::string& to_dir,
                          const WriteHook& hook);

}  // namespace moe::checkpoint_internal
