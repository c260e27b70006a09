// The byte-level corpus and its seeded microbatches.
#include <filesystem>
#include <fstream>
#include <iterator>

#include <fmt/format.h>

#include "leanstep/core.h"
#include "train/internal.h"
#include "train/model.h"

namespace leanstep::train::detail {

Corpus::Corpus(const std::string& path, int64_t min_bytes) : path_(path) {
  if (path.empty()) throw Error("train: no corpus given (key 'train.corpus' of the config)");
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw Error(fmt::format("train: key 'train.corpus' must name a text file (got '{}', which is a directory)", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("train: cannot read corpus '{}'", path));
  bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (size() < min_bytes)
    throw Error(fmt::format("train: corpus '{}' has {} bytes, shorter than one microbatch "
                            "(micro_batch_size * (seq_len + 1) = {} bytes)",
                            path, size(), min_bytes));
}

void Corpus::sample(uint64_t seed, int64_t step, int64_t micro, int64_t batch, int64_t seq, int32_t* tokens) const {
  const uint64_t windows = static_cast<uint64_t>(size() - seq);  // start offsets with seq + 1 bytes after them
  for (int64_t b = 0; b < batch; ++b) {
    Rng rng(mix_seed(seed, static_cast<uint64_t>(step), static_cast<uint64_t>(micro), static_cast<uint64_t>(b)));
    const int64_t start = static_cast<int64_t>(rng.next_u64() % windows);
    for (int64_t i = 0; i <= seq; ++i) tokens[b * (seq + 1) + i] = bytes_[static_cast<size_t>(start + i)];
  }
}

}  // namespace leanstep::train::detail
