// Checkpoint files: parse_safetensors on arbitrary bytes (header length, JSON
// header, offsets, shapes, checksums). Nothing may be read outside the input or
// allocated beyond it.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "train/internal.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  return leanstep::fuzz::run_one([&] {
    const auto f = leanstep::train::detail::parse_safetensors(bytes, "fuzz.safetensors");
    size_t total = 0;
    for (const auto& [name, t] : f.tensors) total += t.data.size() * 4;
    if (total > size) std::abort();  // tensors come from the input's bytes
  });
}
