// Bad input and faults of the training step: configs beyond the documented
// limits, corrupt checkpoints (flipped bytes, non-finite weights, missing
// checksums), leftovers of killed saves. Each is refused with an Error naming
// the key or the tensor, before any state changes.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "leanstep/train.h"
#include "test_util.h"
#include "train/internal.h"

namespace {

using namespace leanstep;
using namespace leanstep::train;
namespace fs = std::filesystem;

const std::string kSource = LEANSTEP_SOURCE_DIR;

Config micro() {
  Config c = load_config(kSource + "/examples/tiny-moe/micro.json");
  c.train.seq_len = 8;
  return c;
}

std::string temp_dir(const std::string& name) {
  const auto dir = fs::temp_directory_path() / ("leanstep_rel_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

nlohmann::json micro_json() {
  std::ifstream in(kSource + "/examples/tiny-moe/micro.json");
  return nlohmann::json::parse(in);
}

std::string edited(const std::string& section, const std::string& key, const nlohmann::json& value) {
  nlohmann::json j = micro_json();
  if (section.empty()) j[key] = value;
  else j[section][key] = value;
  return j.dump();
}

TEST(TrainLimits, SizeKeysBeyondTheLimitsAreErrorsNotAllocations) {
  const std::string dir = kSource + "/examples/tiny-moe";
  EXPECT_LEANSTEP_ERROR(parse_config(edited("", "num_experts", int64_t{1} << 31), dir),
                        "key 'num_experts' must be in [1, 1024] (got 2147483648)");
  EXPECT_LEANSTEP_ERROR(parse_config(edited("", "hidden_size", int64_t{1} << 20), dir),
                        "key 'hidden_size' must be in [1, 65536] (got 1048576)");
  EXPECT_LEANSTEP_ERROR(parse_config(edited("train", "grad_accum_steps", int64_t{1} << 31), dir),
                        "key 'train.grad_accum_steps' must be in [1, 65536] (got 2147483648)");
  EXPECT_LEANSTEP_ERROR(parse_config(edited("", "vocab_size", 100), dir), "key 'vocab_size' must be in [256, 2^20]");
  // Each key within its limit, the whole beyond 2^31 elements.
  EXPECT_LEANSTEP_ERROR(parse_config(edited("train", "seq_len", 65536), dir), "more than the limit of 2^31");
  // 2^63 + 5 does not wrap to a negative number.
  EXPECT_LEANSTEP_ERROR(parse_config(edited("", "num_experts", uint64_t{9223372036854775813ull}), dir),
                        "key 'num_experts' is out of range (got 9223372036854775813)");
  EXPECT_LEANSTEP_ERROR(parse_config(edited("", "num_experts", 4.5), dir), "key 'num_experts' has the wrong type");
  // A plain numel overflow is an Error, never a wrapped value.
  TensorInfo t{"x", {int64_t{1} << 40, int64_t{1} << 40}};
  EXPECT_LEANSTEP_ERROR(t.numel(), "overflows int64");
}

TEST(TrainLimits, UnknownKeysMissingLoraAndHugeNumbersAreErrors) {
  const std::string dir = kSource + "/examples/tiny-moe";
  EXPECT_LEANSTEP_ERROR(parse_config(edited("train", "sedd", 7), dir), "unknown key 'train.sedd' (known: seq_len");
  EXPECT_LEANSTEP_ERROR(parse_config(edited("lora", "alpah", 4), dir), "unknown key 'lora.alpah'");
  nlohmann::json j = micro_json();
  j.erase("lora");
  EXPECT_LEANSTEP_ERROR(parse_config(j.dump(), dir), "missing key 'lora'");
  j = micro_json();
  j["lora"].erase("rank");
  EXPECT_LEANSTEP_ERROR(parse_config(j.dump(), dir), "missing key 'lora.rank'");
  std::string text = micro_json().dump();
  text.replace(text.find("\"lr\":0.01"), 9, "\"lr\":1e400");
  EXPECT_LEANSTEP_ERROR(parse_config(text, dir), "not valid JSON");
}

TEST(TrainLimits, CorpusThatIsADirectoryIsAnError) {
  Config c = micro();
  c.train.corpus = kSource + "/data";
  EXPECT_LEANSTEP_ERROR(Trainer t(c), "key 'train.corpus' must name a text file");
}

// Rewrites the checkpoint with one tensor changed; the checksums are recomputed,
// so only the content checks can refuse it.
void rewrite_with(const std::string& path, const std::string& tensor, float value) {
  detail::SafetensorsFile f = detail::read_safetensors(path);
  f.tensors.at(tensor).data.at(1) = value;
  std::map<std::string, std::string> meta;
  for (const auto& [k, v] : f.metadata)
    if (k.rfind("fnv1a64.", 0) != 0) meta[k] = v;
  std::vector<detail::TensorToWrite> out;
  for (const auto& [name, t] : f.tensors) out.push_back({name, t.shape, t.data.data()});
  detail::write_safetensors(path, out, meta);
}

TEST(TrainCheckpoint, NonFiniteWeightsAreRefusedOnResume) {
  const std::string dir = temp_dir("nan");
  const std::string path = dir + "/adapters.safetensors";
  Config c = micro();
  Trainer a(c);
  a.step();
  a.save(dir);
  const std::string name = a.trainable().at(0).name;
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
    rewrite_with(path, name, bad);
    Trainer b(c);
    EXPECT_LEANSTEP_ERROR(b.load(dir), "tensor '" + name + "' holds " + (std::isnan(bad) ? "nan" : "inf") +
                                           " at element 1: refusing to resume from a corrupt state");
    EXPECT_EQ(b.next_step(), 0);  // nothing changed
  }
  a.save(dir);
  rewrite_with(path, "optimizer.exp_avg_sq." + name, -1.0f);
  Trainer d(c);
  EXPECT_LEANSTEP_ERROR(d.load(dir), "holds -1 at element 1");
  fs::remove_all(dir);
}

TEST(TrainCheckpoint, AFlippedByteFailsItsChecksum) {
  const std::string dir = temp_dir("flip");
  const std::string path = dir + "/adapters.safetensors";
  Config c = micro();
  Trainer a(c);
  a.step();
  a.save(dir);
  const auto size = fs::file_size(path);
  for (uint64_t at : {size - 1, size / 2 + 3}) {
    std::string bytes;
    {
      std::ifstream in(path, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    const std::string good = bytes;
    bytes[at] = static_cast<char>(bytes[at] ^ 0x10);
    {
      std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    }
    Trainer b(c);
    try {
      b.load(dir);
      ADD_FAILURE() << "a flipped byte at " << at << " was accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find("does not match its checksum") != std::string::npos ||
                  what.find("not valid safetensors") != std::string::npos)
          << what;
    }
    std::ofstream(path, std::ios::binary | std::ios::trunc) << good;
  }
  Trainer ok(c);
  EXPECT_NO_THROW(ok.load(dir));
  // A file without checksums (written by another tool) is refused too.
  const detail::SafetensorsFile f = detail::read_safetensors(path);
  std::string header = R"({"__metadata__":{},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  while (header.size() % 8) header += ' ';
  std::string raw(8, '\0');
  raw[0] = static_cast<char>(header.size());
  raw += header + std::string(4, '\0');
  EXPECT_LEANSTEP_ERROR(detail::parse_safetensors(raw, "t"), "tensor 'x' has no checksum");
  // A shape larger than the file never allocates.
  std::string huge = R"({"x":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,4]}})";
  while (huge.size() % 8) huge += ' ';
  std::string raw2(8, '\0');
  raw2[0] = static_cast<char>(huge.size());
  raw2 += huge + std::string(4, '\0');
  EXPECT_LEANSTEP_ERROR(detail::parse_safetensors(raw2, "t"), "has a shape larger than the file");
  // Shape and offset entries are integers in [0, 2^63) before any conversion: a
  // literal beyond 64 bits (held as a double), a float or a negative number is
  // refused by name (a cast of the first was undefined behaviour).
  const std::pair<const char*, const char*> bad_entries[] = {
      {R"("shape":[2,244444444444444444444444],"data_offsets":[0,4])", "has a shape entry that is not an integer"},
      {R"("shape":[1.5],"data_offsets":[0,4])", "has a shape entry that is not an integer"},
      {R"("shape":[-1],"data_offsets":[0,4])", "has a shape entry that is not an integer in [0, 2^63) (got -1)"},
      {R"("shape":[1],"data_offsets":[0,1e30])", "has a data_offsets entry that is not an integer"},
      {R"("shape":[1],"data_offsets":[0,18446744073709551615])", "has a data_offsets entry that is not an integer"},
      {R"("shape":7,"data_offsets":[0,4])", "has a shape that is not a list"}};
  for (const auto& [bad_entry, message] : bad_entries) {
    SCOPED_TRACE(bad_entry);
    std::string text = std::string(R"({"x":{"dtype":"F32",)") + bad_entry + "}}";
    while (text.size() % 8) text += ' ';
    std::string raw3(8, '\0');
    raw3[0] = static_cast<char>(text.size());
    raw3 += text + std::string(4, '\0');
    EXPECT_LEANSTEP_ERROR(detail::parse_safetensors(raw3, "t"), message);
  }
  fs::remove_all(dir);
}

TEST(TrainCheckpoint, StaleTemporariesOfKilledSavesAreRemoved) {
  const std::string dir = temp_dir("stale");
  // 999999999 is above any pid_max: its writer is gone. The parent is alive: its file stays.
  const std::string dead = dir + "/adapters.safetensors.tmp.999999999";
  const std::string live = dir + "/adapters.safetensors.tmp." + std::to_string(::getppid());
  std::ofstream(dead) << "partial";
  std::ofstream(live) << "in progress";
  Trainer a(micro());
  a.save(dir);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(dir + "/adapters.safetensors"));
  fs::remove_all(dir);
}

}  // namespace
