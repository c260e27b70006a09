// Config files for the training step: HF config.json keys for the model plus
// "lora" and "train" objects.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <type_traits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "leanstep/checked.h"
#include "leanstep/train.h"
#include "core/json_integer.h"

namespace leanstep::train {

namespace {

using nlohmann::json;

constexpr const char* kWhere = "train config";
// Limits of the training step's config (docs/train.md, "Limits").
constexpr int64_t kMaxTrainDim = 65536;               // hidden_size, head_dim, moe_intermediate_size, seq_len, ...
constexpr int64_t kMaxTrainCount = 1024;              // layers, heads, experts
constexpr int64_t kMaxTrainTensors = int64_t{1} << 18;  // adapter tensors
constexpr int64_t kMaxTrainElements = int64_t{1} << 31;  // weights + adapter buffers + activations

template <class V>
void read_key(const json& obj, const char* key, V& out, const std::string& prefix, bool required = false) {
  const auto it = obj.find(key);
  if (it == obj.end()) {
    if (required) throw Error(fmt::format("{}: missing key '{}{}'", kWhere, prefix, key));
    return;
  }
  if constexpr (std::is_integral_v<V> && !std::is_same_v<V, bool>) {
    // Integers only (a float would be truncated), never wrapped or narrowed into V.
    const std::optional<V> value = json_integer<V>(*it);
    if (!it->is_number_integer())
      throw Error(fmt::format("{}: key '{}{}' has the wrong type: must be an integer (got {})", kWhere, prefix, key,
                              it->dump()));
    if (!value && std::is_unsigned_v<V> && !it->is_number_unsigned())
      throw Error(fmt::format("{}: key '{}{}' must be >= 0 (got {})", kWhere, prefix, key, it->dump()));
    if (!value) throw Error(fmt::format("{}: key '{}{}' is out of range (got {})", kWhere, prefix, key, it->dump()));
    out = *value;
  } else {
    try {
      out = it->get<V>();
    } catch (const json::exception&) {
      throw Error(fmt::format("{}: key '{}{}' has the wrong type ({})", kWhere, prefix, key, it->dump()));
    }
  }
}

// Keys an object may hold; any other key is an error (a typo must not be ignored).
void check_known_keys(const json& obj, const std::string& prefix, const std::vector<std::string>& known) {
  for (const auto& [key, value] : obj.items()) {
    (void)value;
    if (std::find(known.begin(), known.end(), key) == known.end())
      throw Error(fmt::format("{}: unknown key '{}{}' (known: {})", kWhere, prefix, key, fmt::join(known, ", ")));
  }
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n = checked_mul(n, s, "train", fmt::format("numel of tensor '{}'", name));
  return n;
}

Config parse_config(const std::string& json_text, const std::string& base_dir) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers such as 1e400
    throw Error(fmt::format("{}: not valid JSON: {}", kWhere, e.what()));
  }
  if (!j.is_object()) throw Error(fmt::format("{}: must be a JSON object", kWhere));
  Config c;
  auto& m = c.model;
  read_key(j, "model_type", m.model_type, "", true);
  if (m.model_type != "qwen3_moe")
    throw Error(fmt::format("{}: key 'model_type' must be \"qwen3_moe\" (got \"{}\")", kWhere, m.model_type));
  read_key(j, "hidden_size", m.hidden_size, "", true);
  read_key(j, "num_hidden_layers", m.num_hidden_layers, "", true);
  read_key(j, "num_attention_heads", m.num_attention_heads, "", true);
  read_key(j, "num_key_value_heads", m.num_key_value_heads, "", true);
  m.head_dim = m.num_attention_heads > 0 ? m.hidden_size / m.num_attention_heads : 0;
  read_key(j, "head_dim", m.head_dim, "");
  read_key(j, "num_experts", m.num_experts, "", true);
  read_key(j, "num_experts_per_tok", m.num_experts_per_tok, "", true);
  read_key(j, "moe_intermediate_size", m.moe_intermediate_size, "", true);
  read_key(j, "vocab_size", m.vocab_size, "", true);
  read_key(j, "rope_theta", m.rope_theta, "");
  read_key(j, "rms_norm_eps", m.rms_norm_eps, "");
  read_key(j, "norm_topk_prob", m.norm_topk_prob, "");
  read_key(j, "initializer_range", m.initializer_range, "");
  if (j.contains("hidden_act") && j["hidden_act"] != "silu")
    throw Error(fmt::format("{}: key 'hidden_act' must be \"silu\" (got {})", kWhere, j["hidden_act"].dump()));
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].empty())
    throw Error(fmt::format("{}: key 'mlp_only_layers' must be empty (every layer is MoE here)", kWhere));

  // The adapters are what this step trains: no silent default for them.
  if (!j.contains("lora"))
    throw Error(fmt::format("{}: missing key 'lora' (the adapters: {{\"rank\": R, \"alpha\": A, \"targets\": [...]}})",
                            kWhere));
  {
    const json& l = j["lora"];
    if (!l.is_object()) throw Error(fmt::format("{}: key 'lora' must be an object (got {})", kWhere, l.dump()));
    check_known_keys(l, "lora.", {"rank", "alpha", "targets"});
    read_key(l, "rank", c.lora.rank, "lora.", true);
    read_key(l, "alpha", c.lora.alpha, "lora.", true);
    read_key(l, "targets", c.lora.targets, "lora.");
  }
  if (j.contains("train")) {
    const json& t = j["train"];
    if (!t.is_object()) throw Error(fmt::format("{}: key 'train' must be an object", kWhere));
    check_known_keys(t, "train.",
                     {"seq_len", "micro_batch_size", "grad_accum_steps", "lr", "lr_warmup_steps", "weight_decay",
                      "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "loss_scaling", "initial_loss_scale",
                      "loss_scale_window", "min_loss_scale", "seed", "data_seed", "corpus", "bucket_size"});
    auto& tr = c.train;
    const std::string p = "train.";
    read_key(t, "seq_len", tr.seq_len, p);
    read_key(t, "micro_batch_size", tr.micro_batch_size, p);
    read_key(t, "grad_accum_steps", tr.grad_accum_steps, p);
    read_key(t, "lr", tr.lr, p);
    read_key(t, "lr_warmup_steps", tr.lr_warmup_steps, p);
    read_key(t, "weight_decay", tr.weight_decay, p);
    read_key(t, "adam_beta1", tr.adam_beta1, p);
    read_key(t, "adam_beta2", tr.adam_beta2, p);
    read_key(t, "adam_eps", tr.adam_eps, p);
    read_key(t, "clip_grad", tr.clip_grad, p);
    read_key(t, "loss_scaling", tr.loss_scaling, p);
    read_key(t, "initial_loss_scale", tr.initial_loss_scale, p);
    read_key(t, "loss_scale_window", tr.loss_scale_window, p);
    read_key(t, "min_loss_scale", tr.min_loss_scale, p);
    read_key(t, "seed", tr.seed, p);
    read_key(t, "data_seed", tr.data_seed, p);
    read_key(t, "corpus", tr.corpus, p);
    read_key(t, "bucket_size", tr.bucket_size, p);
    if (!tr.corpus.empty() && std::filesystem::path(tr.corpus).is_relative())
      tr.corpus = (std::filesystem::path(base_dir) / tr.corpus).lexically_normal().string();
  }
  validate(c);
  return c;
}

Config load_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("{}: cannot read '{}'", kWhere, path));
  std::stringstream ss;
  ss << in.rdbuf();
  Config c = parse_config(ss.str(), std::filesystem::path(path).parent_path().string());
  c.source = path;
  return c;
}

void validate(const Config& c) {
  const auto& m = c.model;
  // Every size key is in [1, max] (limits documented in docs/train.md): a step on
  // CPU of a model this large is already far beyond what this example is for.
  auto in_range = [](int64_t v, const char* key, int64_t max, const char* max_text) {
    if (v <= 0 || v > max)
      throw Error(fmt::format("{}: key '{}' must be in [1, {}] (got {})", kWhere, key, max_text, v));
  };
  auto positive = [&](int64_t v, const char* key) { in_range(v, key, kMaxTrainDim, "65536"); };
  positive(m.hidden_size, "hidden_size");
  in_range(m.num_hidden_layers, "num_hidden_layers", kMaxTrainCount, "1024");
  in_range(m.num_attention_heads, "num_attention_heads", kMaxTrainCount, "1024");
  in_range(m.num_key_value_heads, "num_key_value_heads", kMaxTrainCount, "1024");
  positive(m.head_dim, "head_dim");
  in_range(m.num_experts, "num_experts", kMaxTrainCount, "1024");
  in_range(m.num_experts_per_tok, "num_experts_per_tok", kMaxTrainCount, "1024");
  positive(m.moe_intermediate_size, "moe_intermediate_size");
  if (m.vocab_size < 256 || m.vocab_size > (int64_t{1} << 20))
    throw Error(fmt::format("{}: key 'vocab_size' must be in [256, 2^20] (byte tokens need 256; got {})", kWhere,
                            m.vocab_size));
  if (m.head_dim % 2 != 0)
    throw Error(fmt::format("{}: key 'head_dim' must be even for RoPE (got {})", kWhere, m.head_dim));
  if (m.num_attention_heads % m.num_key_value_heads != 0)
    throw Error(fmt::format("{}: key 'num_attention_heads' must be a multiple of 'num_key_value_heads' ({} vs {})",
                            kWhere, m.num_attention_heads, m.num_key_value_heads));
  if (m.num_experts_per_tok > m.num_experts)
    throw Error(fmt::format("{}: key 'num_experts_per_tok' must be <= 'num_experts' ({} > {})", kWhere,
                            m.num_experts_per_tok, m.num_experts));
  auto finite = [](double v, const char* key) {
    if (!std::isfinite(v)) throw Error(fmt::format("{}: key '{}' must be finite (got {})", kWhere, key, v));
  };
  finite(m.rope_theta, "rope_theta");
  finite(m.rms_norm_eps, "rms_norm_eps");
  finite(m.initializer_range, "initializer_range");
  if (!(m.rope_theta > 0)) throw Error(fmt::format("{}: key 'rope_theta' must be > 0 (got {})", kWhere, m.rope_theta));
  if (!(m.rms_norm_eps >= 0))
    throw Error(fmt::format("{}: key 'rms_norm_eps' must be >= 0 (got {})", kWhere, m.rms_norm_eps));
  if (!(m.initializer_range > 0))
    throw Error(fmt::format("{}: key 'initializer_range' must be > 0 (got {})", kWhere, m.initializer_range));

  in_range(c.lora.rank, "lora.rank", 4096, "4096");
  finite(c.lora.alpha, "lora.alpha");
  if (!(c.lora.alpha > 0)) throw Error(fmt::format("{}: key 'lora.alpha' must be > 0 (got {})", kWhere, c.lora.alpha));
  if (c.lora.targets.empty()) throw Error(fmt::format("{}: key 'lora.targets' must not be empty", kWhere));
  static const std::vector<std::string> known = {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"};
  for (const auto& t : c.lora.targets)
    if (std::find(known.begin(), known.end(), t) == known.end())
      throw Error(fmt::format("{}: key 'lora.targets' has unknown module \"{}\" (known: linear_qkv, linear_proj, "
                              "linear_fc1, linear_fc2)",
                              kWhere, t));

  const auto& t = c.train;
  positive(t.seq_len, "train.seq_len");
  positive(t.micro_batch_size, "train.micro_batch_size");
  positive(t.grad_accum_steps, "train.grad_accum_steps");
  for (const auto& [v, key] : {std::pair{t.lr, "train.lr"}, {t.weight_decay, "train.weight_decay"},
                               {t.adam_beta1, "train.adam_beta1"}, {t.adam_beta2, "train.adam_beta2"},
                               {t.adam_eps, "train.adam_eps"}, {t.clip_grad, "train.clip_grad"},
                               {t.initial_loss_scale, "train.initial_loss_scale"},
                               {t.min_loss_scale, "train.min_loss_scale"}, {t.bucket_size, "train.bucket_size"}})
    finite(v, key);
  if (t.lr_warmup_steps > (int64_t{1} << 40))
    throw Error(fmt::format("{}: key 'train.lr_warmup_steps' must be <= 2^40 (got {})", kWhere, t.lr_warmup_steps));
  if (t.loss_scale_window > (int64_t{1} << 40))
    throw Error(fmt::format("{}: key 'train.loss_scale_window' must be <= 2^40 (got {})", kWhere, t.loss_scale_window));
  if (t.bucket_size > 0x1p40)
    throw Error(fmt::format("{}: key 'train.bucket_size' must be <= 2^40 elements (got {})", kWhere, t.bucket_size));
  if (!(t.lr >= 0)) throw Error(fmt::format("{}: key 'train.lr' must be >= 0", kWhere));
  if (t.lr_warmup_steps < 0) throw Error(fmt::format("{}: key 'train.lr_warmup_steps' must be >= 0", kWhere));
  if (!(t.weight_decay >= 0)) throw Error(fmt::format("{}: key 'train.weight_decay' must be >= 0", kWhere));
  if (!(t.adam_beta1 >= 0 && t.adam_beta1 < 1)) throw Error(fmt::format("{}: key 'train.adam_beta1' must be in [0, 1)", kWhere));
  if (!(t.adam_beta2 >= 0 && t.adam_beta2 < 1)) throw Error(fmt::format("{}: key 'train.adam_beta2' must be in [0, 1)", kWhere));
  if (!(t.adam_eps > 0)) throw Error(fmt::format("{}: key 'train.adam_eps' must be > 0", kWhere));
  if (!(t.clip_grad >= 0)) throw Error(fmt::format("{}: key 'train.clip_grad' must be >= 0 (0 disables)", kWhere));
  if (!(t.initial_loss_scale > 0)) throw Error(fmt::format("{}: key 'train.initial_loss_scale' must be > 0", kWhere));
  positive(t.loss_scale_window, "train.loss_scale_window");
  if (!(t.min_loss_scale > 0)) throw Error(fmt::format("{}: key 'train.min_loss_scale' must be > 0", kWhere));
  if (!(t.bucket_size >= 1)) throw Error(fmt::format("{}: key 'train.bucket_size' must be >= 1", kWhere));

  // The memory the step needs, in elements, with checked arithmetic: base weights,
  // the four flat buffers of the adapters, one microbatch's activations kept for
  // the backward. Refused above 2^31 elements (8 GiB of fp32).
  const char* w = "train config";
  const char* what = "the model's size";
  auto mul = [&](std::initializer_list<int64_t> f) { return checked_product(f, w, what); };
  auto add = [&](int64_t a, int64_t b) { return checked_add(a, b, w, what); };
  const int64_t h = m.hidden_size, d = m.head_dim, e = m.num_experts, f = m.moe_intermediate_size;
  const int64_t qdim = mul({m.num_attention_heads, d}), kvdim = mul({m.num_key_value_heads, d});
  const int64_t qkv = add(qdim, mul({2, kvdim}));
  const int64_t n = mul({t.micro_batch_size, t.seq_len}), nout = mul({n, m.num_experts_per_tok});
  int64_t layer = add(mul({qkv, h}), mul({h, qdim}));
  layer = add(layer, mul({e, h}));
  layer = add(layer, mul({3, e, f, h}));
  int64_t act = mul({n, add(add(mul({10, h}), mul({3, qkv})), mul({3, e}))});
  act = add(act, mul({t.micro_batch_size, m.num_attention_heads, t.seq_len, t.seq_len}));
  act = add(act, mul({nout, add(mul({3, h}), mul({4, f}))}));
  // Adapter elements and tensors per layer (as adapter_tensors lists them), without building the list.
  auto has = [&](const char* target) {
    return std::find(c.lora.targets.begin(), c.lora.targets.end(), target) != c.lora.targets.end();
  };
  const int64_t r = c.lora.rank;
  int64_t per_layer = 0, tensors_per_layer = 0;
  if (has("linear_qkv")) per_layer = add(per_layer, mul({r, add(h, qkv)})), tensors_per_layer += 2;
  if (has("linear_proj")) per_layer = add(per_layer, mul({r, add(qdim, h)})), tensors_per_layer += 2;
  if (has("linear_fc1")) per_layer = add(per_layer, mul({e, r, add(h, mul({2, f}))})), tensors_per_layer += 2 * e;
  if (has("linear_fc2")) per_layer = add(per_layer, mul({e, r, add(f, h)})), tensors_per_layer += 2 * e;
  const int64_t adapters = mul({m.num_hidden_layers, per_layer});
  if (mul({m.num_hidden_layers, tensors_per_layer}) > kMaxTrainTensors)
    throw Error(fmt::format("{}: the adapters would be {} tensors, more than the limit of 2^18 = 262144; reduce "
                            "num_hidden_layers or num_experts (got {} x {})",
                            kWhere, mul({m.num_hidden_layers, tensors_per_layer}), m.num_hidden_layers,
                            tensors_per_layer));
  int64_t total = mul({m.num_hidden_layers, add(layer, act)});
  total = add(total, mul({2, m.vocab_size, h}));
  total = add(total, mul({2, n, m.vocab_size}));
  total = add(total, mul({4, adapters}));
  if (total > kMaxTrainElements)
    throw Error(fmt::format("{}: the model, its adapters and one microbatch's activations need {} elements, more than "
                            "the limit of 2^31 (8 GiB of fp32); reduce hidden_size, num_experts, num_hidden_layers, "
                            "seq_len or micro_batch_size",
                            kWhere, total));
}

std::vector<TensorInfo> adapter_tensors(const ModelConfig& m, const LoraConfig& lora) {
  auto has = [&](const char* t) { return std::find(lora.targets.begin(), lora.targets.end(), t) != lora.targets.end(); };
  const int64_t h = m.hidden_size, r = lora.rank, qdim = m.num_attention_heads * m.head_dim;
  const int64_t qkv = qdim + 2 * m.num_key_value_heads * m.head_dim, f = m.moe_intermediate_size;
  std::vector<TensorInfo> out;
  for (int64_t l = 0; l < m.num_hidden_layers; ++l) {
    const std::string p = fmt::format("decoder.layers.{}.", l);
    if (has("linear_qkv")) {
      out.push_back({p + "self_attention.linear_qkv.lora_A.weight", {r, h}});
      out.push_back({p + "self_attention.linear_qkv.lora_B.weight", {qkv, r}});
    }
    if (has("linear_proj")) {
      out.push_back({p + "self_attention.linear_proj.lora_A.weight", {r, qdim}});
      out.push_back({p + "self_attention.linear_proj.lora_B.weight", {h, r}});
    }
    for (const char* fc : {"linear_fc1", "linear_fc2"}) {
      if (!has(fc)) continue;
      const bool one = std::string(fc) == "linear_fc1";
      const int64_t in = one ? h : f, outd = one ? 2 * f : h;
      for (int64_t e = 0; e < m.num_experts; ++e)
        out.push_back({fmt::format("{}mlp.experts.{}.lora_A.weight{}", p, fc, e), {r, in}});
      for (int64_t e = 0; e < m.num_experts; ++e)
        out.push_back({fmt::format("{}mlp.experts.{}.lora_B.weight{}", p, fc, e), {outd, r}});
    }
  }
  return out;
}

}  // namespace leanstep::train
