// 64-bit FNV-1a: microbatch hashes and the checkpoint's per-tensor checksums
// (its own file so that the safetensors codec builds alone, e.g. for fuzzing).
#include "train/model.h"

namespace leanstep::train::detail {

uint64_t fnv1a(const void* data, size_t bytes, uint64_t hash) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 0x100000001B3ull;
  return hash;
}

}  // namespace leanstep::train::detail
