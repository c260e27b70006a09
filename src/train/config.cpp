// Config files for the training step: HF config.json keys for the model plus
// "lora" and "train" objects.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "leanstep/train.h"

namespace leanstep::train {

namespace {

using nlohmann::json;

constexpr const char* kWhere = "train config";

template <class V>
void read_key(const json& obj, const char* key, V& out, const std::string& prefix, bool required = false) {
  const auto it = obj.find(key);
  if (it == obj.end()) {
    if (required) throw Error(fmt::format("{}: missing key '{}{}'", kWhere, prefix, key));
    return;
  }
  try {
    out = it->get<V>();
  } catch (const json::exception&) {
    throw Error(fmt::format("{}: key '{}{}' has the wrong type ({})", kWhere, prefix, key, it->dump()));
  }
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Config parse_config(const std::string& json_text, const std::string& base_dir) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::parse_error& e) {
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

  if (j.contains("lora")) {
    const json& l = j["lora"];
    if (!l.is_object()) throw Error(fmt::format("{}: key 'lora' must be an object", kWhere));
    read_key(l, "rank", c.lora.rank, "lora.");
    read_key(l, "alpha", c.lora.alpha, "lora.");
    read_key(l, "targets", c.lora.targets, "lora.");
  }
  if (j.contains("train")) {
    const json& t = j["train"];
    if (!t.is_object()) throw Error(fmt::format("{}: key 'train' must be an object", kWhere));
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
  auto positive = [](int64_t v, const char* key) {
    if (v <= 0) throw Error(fmt::format("{}: key '{}' must be > 0 (got {})", kWhere, key, v));
  };
  positive(m.hidden_size, "hidden_size");
  positive(m.num_hidden_layers, "num_hidden_layers");
  positive(m.num_attention_heads, "num_attention_heads");
  positive(m.num_key_value_heads, "num_key_value_heads");
  positive(m.head_dim, "head_dim");
  positive(m.num_experts, "num_experts");
  positive(m.num_experts_per_tok, "num_experts_per_tok");
  positive(m.moe_intermediate_size, "moe_intermediate_size");
  positive(m.vocab_size, "vocab_size");
  if (m.head_dim % 2 != 0)
    throw Error(fmt::format("{}: key 'head_dim' must be even for RoPE (got {})", kWhere, m.head_dim));
  if (m.num_attention_heads % m.num_key_value_heads != 0)
    throw Error(fmt::format("{}: key 'num_attention_heads' must be a multiple of 'num_key_value_heads' ({} vs {})",
                            kWhere, m.num_attention_heads, m.num_key_value_heads));
  if (m.num_experts_per_tok > m.num_experts)
    throw Error(fmt::format("{}: key 'num_experts_per_tok' must be <= 'num_experts' ({} > {})", kWhere,
                            m.num_experts_per_tok, m.num_experts));
  if (m.vocab_size > (int64_t{1} << 30))
    throw Error(fmt::format("{}: key 'vocab_size' must be < 2^30 (got {})", kWhere, m.vocab_size));
  if (!(m.rope_theta > 0)) throw Error(fmt::format("{}: key 'rope_theta' must be > 0", kWhere));
  if (!(m.rms_norm_eps >= 0)) throw Error(fmt::format("{}: key 'rms_norm_eps' must be >= 0", kWhere));
  if (!(m.initializer_range > 0)) throw Error(fmt::format("{}: key 'initializer_range' must be > 0", kWhere));

  positive(c.lora.rank, "lora.rank");
  if (!(c.lora.alpha > 0)) throw Error(fmt::format("{}: key 'lora.alpha' must be > 0", kWhere));
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
