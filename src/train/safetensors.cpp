// A minimal safetensors writer/reader for float32 tensors (the checkpoint format).
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "leanstep/core.h"
#include "leanstep/checked.h"
#include "core/json_integer.h"
#include "train/internal.h"
#include "train/model.h"

namespace leanstep::train::detail {

namespace {

static_assert(sizeof(float) == 4);

bool little_endian() {
  const uint16_t one = 1;
  unsigned char b;
  std::memcpy(&b, &one, 1);
  return b == 1;
}

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

// Removes "<name>.tmp.<pid>" files that a killed save left behind: those whose
// process no longer exists (a live writer's temporary file is left alone).
void remove_stale_temporaries(const std::filesystem::path& final_path) {
  namespace fs = std::filesystem;
  const fs::path dir = final_path.parent_path().empty() ? fs::path(".") : final_path.parent_path();
  const std::string prefix = final_path.filename().string() + ".tmp.";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string pid_text = name.substr(prefix.size());
    if (pid_text.empty() || pid_text.size() > 9 || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid == ::getpid()) continue;
    if (::kill(pid, 0) == -1 && errno == ESRCH) fs::remove(entry.path(), ec);
  }
}

}  // namespace

std::string checksum_key(const std::string& tensor_name) { return "fnv1a64." + tensor_name; }

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  if (!little_endian()) throw Error("train: safetensors writer supports little-endian hosts only");
  nlohmann::ordered_json header;
  // Every tensor's bytes carry a checksum (64-bit FNV-1a; any one changed byte changes
  // it), verified by read_safetensors.
  std::map<std::string, std::string> meta = metadata;
  for (const auto& t : tensors) {
    int64_t n = 1;
    for (int64_t s : t.shape) n = checked_mul(n, s, "train: safetensors", "tensor size");
    meta[checksum_key(t.name)] = hex64(fnv1a(t.data, static_cast<size_t>(n) * 4));
  }
  header["__metadata__"] = meta;
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
  remove_stale_temporaries(final_path);
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
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw Error(fmt::format("train: cannot read checkpoint '{}': it is a directory", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("train: cannot read checkpoint '{}'", path));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw Error(fmt::format("train: cannot read checkpoint '{}'", path));
  return parse_safetensors(bytes, path);
}

namespace {

// A header list of integers in [0, 2^63), checked before any conversion: a
// float or an out-of-range literal (nlohmann holds those as doubles) must not
// be cast.
template <class Bad>
std::vector<uint64_t> header_integers(const nlohmann::json& entry, const std::string& name, const char* key,
                                      const Bad& bad) {
  const nlohmann::json& list = entry.at(key);
  if (!list.is_array()) throw bad(fmt::format("tensor '{}' has a {} that is not a list", name, key));
  std::vector<uint64_t> values;
  for (const nlohmann::json& v : list) {
    const std::optional<int64_t> value = json_integer<int64_t>(v);
    if (!value || *value < 0)
      throw bad(fmt::format("tensor '{}' has a {} entry that is not an integer in [0, 2^63) (got {})", name, key,
                            v.dump()));
    values.push_back(static_cast<uint64_t>(*value));
  }
  return values;
}

}  // namespace

SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& path) {
  const uint64_t file_size = bytes.size();
  auto bad = [&](const std::string& why) { return Error(fmt::format("train: checkpoint '{}' is not valid safetensors: {}", path, why)); };
  if (file_size < 8) throw bad("shorter than the 8-byte header length");
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[static_cast<size_t>(i)])) << (8 * i);
  if (len > file_size - 8) throw bad(fmt::format("header length {} exceeds the file", len));
  const std::string text = bytes.substr(8, static_cast<size_t>(len));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw bad(fmt::format("header is not JSON ({})", e.what()));
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  const uint64_t data_begin = 8 + len, data_size = file_size - data_begin;
  SafetensorsFile out;
  if (header.contains("__metadata__")) {
    const auto& entry = header["__metadata__"];
    if (!entry.is_object()) throw bad("__metadata__ is not an object");
    for (const auto& [k, v] : entry.items()) {
      if (!v.is_string()) throw bad(fmt::format("metadata '{}' is not a string", k));
      out.metadata[k] = v.get<std::string>();
    }
  }
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      if (!entry.is_object()) throw bad(fmt::format("tensor '{}' entry is not an object", name));
      if (entry.at("dtype") != "F32") throw bad(fmt::format("tensor '{}' has dtype {} (only F32 is written here)", name, entry.at("dtype").dump()));
      StoredTensor t;
      for (uint64_t s : header_integers(entry, name, "shape", bad)) t.shape.push_back(static_cast<int64_t>(s));
      const std::vector<uint64_t> offs = header_integers(entry, name, "data_offsets", bad);
      uint64_t n = 1;
      for (int64_t s : t.shape) {
        // Bounded by the file: a shape whose element count exceeds the data cannot match.
        if (s != 0 && n > data_size / 4 / static_cast<uint64_t>(s))
          throw bad(fmt::format("tensor '{}' has a shape larger than the file", name));
        n *= static_cast<uint64_t>(s);
      }
      if (offs.size() != 2 || offs[0] > offs[1] || offs[1] > data_size || offs[1] - offs[0] != n * 4)
        throw bad(fmt::format("tensor '{}' has data_offsets that do not match its shape or the file", name));
      const char* src = bytes.data() + data_begin + offs[0];
      const auto sum = out.metadata.find(checksum_key(name));
      if (sum == out.metadata.end())
        throw bad(fmt::format("tensor '{}' has no checksum (metadata '{}')", name, checksum_key(name)));
      if (sum->second != hex64(fnv1a(src, static_cast<size_t>(n) * 4)))
        throw Error(fmt::format("train: checkpoint '{}' is corrupt: tensor '{}' does not match its checksum", path, name));
      t.data.resize(n);
      if (n > 0) std::memcpy(t.data.data(), src, static_cast<size_t>(n) * 4);
      out.tensors.emplace(name, std::move(t));
    } catch (const nlohmann::json::exception& e) {
      throw bad(fmt::format("tensor '{}' entry is malformed ({})", name, e.what()));
    }
  }
  return out;
}

}  // namespace leanstep::train::detail
