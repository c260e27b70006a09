// Reading Hugging Face config.json files into a ModelConfig.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "leanstep/checked.h"
#include "leanstep/lora.h"
#include "core/json_integer.h"

namespace leanstep::lora {
namespace {

using nlohmann::json;

constexpr int64_t kMaxLayers = 16384;
constexpr int64_t kMaxExperts = 65536;
constexpr int64_t kMaxSize = int64_t{1} << 24;

// Reads keys of one JSON object; errors name the source, the full key path and the model_type.
class KeyReader {
 public:
  KeyReader(const json& obj, std::string prefix, std::string_view source, std::string_view model_type)
      : obj_(obj), prefix_(std::move(prefix)), source_(source), model_type_(model_type) {}

  bool has(const char* key) const { return obj_.contains(key) && !obj_.at(key).is_null(); }
  std::string path(const char* key) const { return prefix_ + key; }

  [[noreturn]] void fail(const char* key, const std::string& rule) const {
    throw Error(fmt::format("lora config {}: key '{}' {} (model_type {})", source_, path(key), rule,
                            model_type_));
  }

  const json& object(const char* key) const {
    if (!has(key)) fail(key, "is missing");
    if (!obj_.at(key).is_object()) fail(key, "must be an object");
    return obj_.at(key);
  }

  // A positive integer (>= min_value).
  int64_t integer(const char* key, int64_t min_value = 1) const {
    if (!has(key)) fail(key, "is missing");
    return checked_integer(key, min_value);
  }
  int64_t integer_or(const char* key, int64_t fallback, int64_t min_value = 0) const {
    return has(key) ? checked_integer(key, min_value) : fallback;
  }
  bool boolean_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!obj_.at(key).is_boolean()) fail(key, fmt::format("must be true or false (got {})", obj_.at(key).dump()));
    return obj_.at(key).get<bool>();
  }
  std::vector<int64_t> integer_list_or_empty(const char* key) const {
    std::vector<int64_t> out;
    if (!has(key)) return out;
    const json& v = obj_.at(key);
    if (!v.is_array()) fail(key, fmt::format("must be a list of integers (got {})", v.dump()));
    for (const json& e : v) {
      const std::optional<int64_t> value = json_integer<int64_t>(e);
      if (!value) fail(key, fmt::format("must be a list of integers (got {})", v.dump()));
      out.push_back(*value);
    }
    return out;
  }
  std::vector<std::string> string_list(const char* key) const {
    const json& v = obj_.at(key);
    std::vector<std::string> out;
    if (!v.is_array()) fail(key, "must be a list of strings");
    for (const json& e : v) {
      if (!e.is_string()) fail(key, "must be a list of strings");
      out.push_back(e.get<std::string>());
    }
    return out;
  }

 private:
  int64_t checked_integer(const char* key, int64_t min_value) const {
    const json& v = obj_.at(key);
    const int64_t max_value = max_config_value(key);
    int64_t value = 0;
    if (v.is_number_integer()) {
      const std::optional<int64_t> integer = json_integer<int64_t>(v);
      if (!integer) fail(key, fmt::format("must be <= {} (got {})", max_value, v.dump()));  // above 2^63 - 1
      value = *integer;
    } else {
      // Accept 4096.0 as written by some exporters, but not 4096.5 or "4096".
      const bool finite = v.is_number_float() && std::isfinite(v.get<double>());
      if (finite && std::fabs(v.get<double>()) >= 0x1p62)
        fail(key, fmt::format("must be <= {} (got {})", max_value, v.dump()));
      if (!finite || v.get<double>() != std::floor(v.get<double>()))
        fail(key, fmt::format("must be an integer (got {})", v.dump()));
      value = static_cast<int64_t>(v.get<double>());
    }
    if (value < min_value) fail(key, fmt::format("must be >= {} (got {})", min_value, value));
    if (value > max_value) fail(key, fmt::format("must be <= {} (got {})", max_value, value));
    return value;
  }

  // Limits of config values (docs/lora.md, "Limits"): layer counts 16384, expert
  // counts 65536, every other size 2^24. Beyond them no real model exists, and the
  // plan's memory grows with layers x experts.
  static int64_t max_config_value(std::string_view key) {
    if (key == "num_hidden_layers" || key == "depth" || key == "encoder_layers") return kMaxLayers;
    if (key == "num_experts") return kMaxExperts;
    return kMaxSize;
  }

  const json& obj_;
  std::string prefix_;
  std::string_view source_;
  std::string_view model_type_;
};

enum class Family { kDense, kMoE, kOmni, kQwen3_5, kQwen3Next };

constexpr const char* kSupported = "llama, qwen3, qwen3_moe, qwen3_omni_moe, qwen3_5_moe, qwen3_next";

void read_attention(const KeyReader& r, ModelConfig& c, bool head_dim_may_default) {
  c.hidden_size = r.integer("hidden_size");
  c.num_layers = r.integer("num_hidden_layers");
  c.num_attention_heads = r.integer("num_attention_heads");
  // HF llama semantics: no num_key_value_heads means multi-head attention, no
  // head_dim means hidden_size / num_attention_heads. The Qwen families always
  // write both in their checkpoints, so there a missing key is an error.
  if (head_dim_may_default) {
    c.num_key_value_heads = r.integer_or("num_key_value_heads", c.num_attention_heads, 1);
    if (!r.has("head_dim") && c.hidden_size % c.num_attention_heads != 0)
      r.fail("head_dim", fmt::format("is missing and hidden_size {} is not divisible by num_attention_heads {}",
                                     c.hidden_size, c.num_attention_heads));
    c.head_dim = r.integer_or("head_dim", c.hidden_size / c.num_attention_heads, 1);
  } else {
    c.num_key_value_heads = r.integer("num_key_value_heads");
    c.head_dim = r.integer("head_dim");
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    r.fail("num_key_value_heads", fmt::format("must divide num_attention_heads {} (got {})",
                                              c.num_attention_heads, c.num_key_value_heads));
}

// MoE layers: every layer unless mlp_only_layers or decoder_sparse_step say otherwise (HF rule:
// layer i is sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0).
void read_moe(const KeyReader& r, ModelConfig& c) {
  c.num_experts = r.integer("num_experts");
  c.moe_intermediate_size = r.integer("moe_intermediate_size");
  c.shared_expert_intermediate_size = r.integer_or("shared_expert_intermediate_size", 0, 0);
  int64_t sparse_step = r.integer_or("decoder_sparse_step", 1, 1);
  std::vector<int64_t> mlp_only = r.integer_list_or_empty("mlp_only_layers");
  for (int64_t i : mlp_only)
    if (i < 0 || i >= c.num_layers)
      r.fail("mlp_only_layers", fmt::format("has layer {} outside [0, {})", i, c.num_layers));
  bool any_dense = false;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    bool dense = std::find(mlp_only.begin(), mlp_only.end(), i) != mlp_only.end() || (i + 1) % sparse_step != 0;
    c.layers[i].mlp = dense ? MlpKind::kDense : MlpKind::kMoE;
    any_dense |= dense;
  }
  // Dense layers of a MoE model use intermediate_size; only then is it required.
  if (any_dense) c.intermediate_size = r.integer("intermediate_size");
}

void read_hybrid(const KeyReader& r, ModelConfig& c) {
  c.linear_num_key_heads = r.integer("linear_num_key_heads");
  c.linear_key_head_dim = r.integer("linear_key_head_dim");
  c.linear_num_value_heads = r.integer("linear_num_value_heads");
  c.linear_value_head_dim = r.integer("linear_value_head_dim");
  if (r.has("layer_types")) {
    std::vector<std::string> types = r.string_list("layer_types");
    if (static_cast<int64_t>(types.size()) != c.num_layers)
      r.fail("layer_types", fmt::format("must have num_hidden_layers = {} entries (got {})", c.num_layers, types.size()));
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i] == "linear_attention") c.layers[i].attention = AttentionKind::kLinear;
      else if (types[i] == "full_attention") c.layers[i].attention = AttentionKind::kFull;
      else
        r.fail("layer_types", fmt::format("entry {} must be \"linear_attention\" or \"full_attention\" (got \"{}\")",
                                          i, types[i]));
    }
  } else if (r.has("full_attention_interval")) {
    int64_t interval = r.integer("full_attention_interval");
    for (int64_t i = 0; i < c.num_layers; ++i)
      c.layers[i].attention = (i + 1) % interval == 0 ? AttentionKind::kFull : AttentionKind::kLinear;
  } else {
    r.fail("layer_types", "is missing (and so is full_attention_interval): the hybrid layer pattern is unknown");
  }
}

VisionTower read_vision(const KeyReader& r) {
  return VisionTower{r.integer("depth"), r.integer("hidden_size"), r.integer("intermediate_size")};
}

AudioTower read_audio(const KeyReader& r) {
  AudioTower a;
  a.layers = r.integer("encoder_layers");
  a.d_model = r.integer("d_model");
  a.ffn_dim = r.integer("encoder_ffn_dim");
  // conv_out flattens the channels of the three stride-2 convolutions over the mel bins.
  if (r.has("downsample_hidden_size") && r.has("num_mel_bins")) {
    int64_t mel = r.integer("num_mel_bins");
    for (int k = 0; k < 3; ++k) mel = (mel + 1) / 2;
    a.conv_out_in = checked_mul(r.integer("downsample_hidden_size"), mel, "lora config", "conv_out input size");
  }
  a.output_dim = r.integer_or("output_dim", 0, 1);
  return a;
}

}  // namespace

ModelConfig parse_model_config(const json& config, std::string_view source) {
  if (!config.is_object()) throw Error(fmt::format("lora config {}: must be a JSON object", source));
  if (!config.contains("model_type") || !config["model_type"].is_string())
    throw Error(fmt::format("lora config {}: key 'model_type' is missing (supported: {})", source, kSupported));
  ModelConfig c;
  c.model_type = config["model_type"].get<std::string>();
  Family family;
  if (c.model_type == "llama" || c.model_type == "qwen3") family = Family::kDense;
  else if (c.model_type == "qwen3_moe") family = Family::kMoE;
  else if (c.model_type == "qwen3_omni_moe") family = Family::kOmni;
  else if (c.model_type == "qwen3_5_moe") family = Family::kQwen3_5;
  else if (c.model_type == "qwen3_next") family = Family::kQwen3Next;
  else
    throw Error(fmt::format("lora config {}: unknown model_type '{}' (supported: {})", source, c.model_type, kSupported));

  KeyReader top(config, "", source, c.model_type);
  // The language model's keys: top level, thinker_config.text_config (Omni) or text_config (Qwen3.5).
  const json* text = &config;
  std::string text_prefix;
  if (family == Family::kOmni) {
    const json& thinker = top.object("thinker_config");
    KeyReader tr(thinker, "thinker_config.", source, c.model_type);
    text = &tr.object("text_config");
    text_prefix = "thinker_config.text_config.";
    if (tr.has("vision_config"))
      c.vision = read_vision(KeyReader(tr.object("vision_config"), "thinker_config.vision_config.", source, c.model_type));
    if (tr.has("audio_config"))
      c.audio = read_audio(KeyReader(tr.object("audio_config"), "thinker_config.audio_config.", source, c.model_type));
  } else if (family == Family::kQwen3_5) {
    text = &top.object("text_config");
    text_prefix = "text_config.";
    if (top.has("vision_config"))
      c.vision = read_vision(KeyReader(top.object("vision_config"), "vision_config.", source, c.model_type));
  }
  KeyReader r(*text, text_prefix, source, c.model_type);
  read_attention(r, c, c.model_type == "llama");
  c.layers.assign(static_cast<size_t>(c.num_layers), LayerSpec{});
  if (family == Family::kDense) {
    c.intermediate_size = r.integer("intermediate_size");
  } else {
    read_moe(r, c);
  }
  if (family == Family::kQwen3_5 || family == Family::kQwen3Next) {
    read_hybrid(r, c);
    c.linear_attention = family == Family::kQwen3_5 ? LinearAttentionNaming::kQwen3_5 : LinearAttentionNaming::kQwen3Next;
    // Both HF implementations gate the full-attention output (q_proj doubled).
    // Qwen3-Next has no key for it; Qwen3.5 writes attn_output_gate.
    c.attn_output_gate = r.boolean_or("attn_output_gate", true);
  }
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("lora config {}: cannot open the file", path));
  json config;
  try {
    config = json::parse(in);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers such as 1e400
    throw Error(fmt::format("lora config {}: not valid JSON ({})", path, e.what()));
  }
  return parse_model_config(config, path);
}

}  // namespace leanstep::lora
