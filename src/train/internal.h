// Internal pieces of the trainer: the byte corpus and the safetensors codec.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace leanstep::train::detail {

// A text file as byte tokens; microbatches are windows at seeded offsets.
class Corpus {
 public:
  Corpus() = default;
  // `min_bytes`: the file must hold at least one microbatch (micro_batch * (seq_len + 1)).
  Corpus(const std::string& path, int64_t min_bytes);
  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  // tokens[batch, seq + 1]: row b starts at an offset drawn from (seed, step, micro, b).
  // `micro` is the GLOBAL microbatch index within the step (rank * accum + m), so the
  // data of a step does not depend on how microbatches are spread over ranks.
  void sample(uint64_t seed, int64_t step, int64_t micro, int64_t batch, int64_t seq, int32_t* tokens) const;

 private:
  std::string path_;
  std::vector<uint8_t> bytes_;
};

// A float32 tensor of a safetensors file.
struct StoredTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, StoredTensor> tensors;
};

struct TensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
};

// safetensors: 8-byte little-endian header length, JSON header ({name: {dtype,
// shape, data_offsets}}, "__metadata__": {string: string}), padded with spaces to
// a multiple of 8, then the raw little-endian data. Written to a temporary file
// in the same directory, flushed to disk and renamed over `path` (atomic).
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata);
// Reads and validates a file written by write_safetensors (F32 tensors only): the
// header, every offset, and every tensor's checksum (metadata "fnv1a64.<name>").
SafetensorsFile read_safetensors(const std::string& path);
// The same from the file's bytes; `path` names it in messages.
SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& path);
// The metadata key of a tensor's checksum.
std::string checksum_key(const std::string& tensor_name);

}  // namespace leanstep::train::detail
