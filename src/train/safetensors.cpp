// A minimal safetensors writer/reader for float32 tensors (the checkpoint format).
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "leanstep/core.h"
#include "train/internal.h"

namespace leanstep::train::detail {

namespace {

static_assert(sizeof(float) == 4);

bool little_endian() {
  const uint16_t one = 1;
  unsigned char b;
  std::memcpy(&b, &one, 1);
  return b == 1;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  if (!little_endian()) throw Error("train: safetensors writer supports little-endian hosts only");
  nlohmann::ordered_json header;
  header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    int64_t n = 1;
    for (int64_t s : t.shape) n *= s;
    const uint64_t bytes = static_cast<uint64_t>(n) * 4;
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');

  const std::filesystem::path final_path(path);
  const std::string tmp = (final_path.parent_path() / (final_path.filename().string() + fmt::format(".tmp.{}", ::getpid()))).string();
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw Error(fmt::format("train: cannot write checkpoint '{}'", tmp));
  bool ok = true;
  const uint64_t len = text.size();
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(len >> (8 * i));
  ok = ok && std::fwrite(len_bytes, 1, 8, f) == 8;
  ok = ok && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  for (const auto& t : tensors) {
    int64_t n = 1;
    for (int64_t s : t.shape) n *= s;
    if (n > 0) ok = ok && std::fwrite(t.data, 4, static_cast<size_t>(n), f) == static_cast<size_t>(n);
  }
  ok = ok && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    throw Error(fmt::format("train: writing checkpoint '{}' failed (disk full?)", path));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, final_path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    throw Error(fmt::format("train: cannot move checkpoint into place at '{}': {}", path, ec.message()));
  }
}

SafetensorsFile read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("train: cannot read checkpoint '{}'", path));
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  auto bad = [&](const std::string& why) { return Error(fmt::format("train: checkpoint '{}' is not valid safetensors: {}", path, why)); };
  if (file_size < 8) throw bad("shorter than the 8-byte header length");
  unsigned char len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  if (len > file_size - 8) throw bad(fmt::format("header length {} exceeds the file", len));
  std::string text(len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(len));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw bad(fmt::format("header is not JSON ({})", e.what()));
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  const uint64_t data_begin = 8 + len, data_size = file_size - data_begin;
  SafetensorsFile out;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw bad("__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) throw bad(fmt::format("metadata '{}' is not a string", k));
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    try {
      if (entry.at("dtype") != "F32") throw bad(fmt::format("tensor '{}' has dtype {} (only F32 is written here)", name, entry.at("dtype").dump()));
      StoredTensor t;
      t.shape = entry.at("shape").get<std::vector<int64_t>>();
      const auto offs = entry.at("data_offsets").get<std::vector<uint64_t>>();
      uint64_t n = 1;
      for (int64_t s : t.shape) {
        if (s < 0) throw bad(fmt::format("tensor '{}' has a negative dimension", name));
        n *= static_cast<uint64_t>(s);
      }
      if (offs.size() != 2 || offs[0] > offs[1] || offs[1] > data_size || offs[1] - offs[0] != n * 4)
        throw bad(fmt::format("tensor '{}' has data_offsets that do not match its shape or the file", name));
      t.data.resize(n);
      in.seekg(static_cast<std::streamoff>(data_begin + offs[0]));
      in.read(reinterpret_cast<char*>(t.data.data()), static_cast<std::streamsize>(n * 4));
      if (!in) throw bad(fmt::format("tensor '{}' could not be read", name));
      out.tensors.emplace(name, std::move(t));
    } catch (const nlohmann::json::exception& e) {
      throw bad(fmt::format("tensor '{}' entry is malformed ({})", name, e.what()));
    }
  }
  return out;
}

}  // namespace leanstep::train::detail
