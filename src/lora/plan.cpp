// Module enumeration, target resolution and the per-rank plan.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "leanstep/checked.h"
#include "leanstep/lora.h"

namespace leanstep::lora {
namespace {

constexpr const char* kWhere = "lora::plan";
constexpr int64_t kMaxLoraRank = int64_t{1} << 20;
constexpr int64_t kMaxParallel = 65536;
constexpr int64_t kMaxRanks = int64_t{1} << 20;
constexpr int64_t kMaxPlanLayers = 16384;
constexpr int64_t kMaxPlanExperts = 65536;
constexpr int64_t kMaxStageTensors = int64_t{1} << 22;  // layout entries of one stage

Module make_module(std::string prefix, std::string local_name, ModulePart part, int64_t layer, int64_t in,
                   int64_t out, TensorSplit split) {
  Module m;
  m.name = prefix.empty() ? local_name : prefix + "." + local_name;
  m.local_name = std::move(local_name);
  m.part = part;
  m.layer = layer;
  m.in_features = in;
  m.out_features = out;
  m.split = split;
  return m;
}

// `name` ends with `suffix` at a '.' boundary: "linear_fc1" matches "mlp.experts.linear_fc1",
// "experts.linear_fc1" does not match "mlp.shared_experts.linear_fc1".
bool suffix_matches(std::string_view name, std::string_view suffix) {
  if (suffix.empty() || suffix.size() > name.size()) return false;
  if (name.substr(name.size() - suffix.size()) != suffix) return false;
  return suffix.size() == name.size() || name[name.size() - suffix.size() - 1] == '.';
}

const char* part_name(ModulePart part) {
  switch (part) {
    case ModulePart::kLanguage: return "language";
    case ModulePart::kVision: return "vision tower";
    case ModulePart::kAudio: return "audio tower";
  }
  return "?";
}

// A readable pattern of a module name: the layer/block index replaced by '*'.
std::string name_pattern(const Module& m) {
  if (m.layer < 0) return m.name;
  std::string needle = fmt::format(".{}.", m.layer);
  auto pos = m.name.find(needle);
  if (pos == std::string::npos) return m.name;
  return m.name.substr(0, pos) + ".*." + m.name.substr(pos + needle.size());
}

}  // namespace

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n = checked_mul(n, d, "lora", fmt::format("numel of tensor '{}'", name));
  return n;
}

bool is_expert_tensor(std::string_view name) {
  // Routed experts only: ".mlp.experts." is not a substring of ".mlp.shared_experts.".
  return name.find(".mlp.experts.") != std::string_view::npos;
}

const char* scope_name(Scope scope) { return scope == Scope::kAll ? "all" : "language"; }

Scope scope_from_name(std::string_view name) {
  if (name == "language") return Scope::kLanguage;
  if (name == "all") return Scope::kAll;
  throw_arg_error("lora", "scope", fmt::format("must be \"language\" or \"all\" (got \"{}\")", name));
}

std::vector<Module> enumerate_modules(const ModelConfig& c) {
  // A config built in code is held to the limits load_model_config enforces, so no
  // size below can overflow (each is at most a few products of values <= 2^24).
  const std::pair<const char*, int64_t> sizes[] = {
      {"hidden_size", c.hidden_size}, {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads}, {"head_dim", c.head_dim},
      {"intermediate_size", c.intermediate_size}, {"moe_intermediate_size", c.moe_intermediate_size},
      {"shared_expert_intermediate_size", c.shared_expert_intermediate_size},
      {"linear_num_key_heads", c.linear_num_key_heads}, {"linear_key_head_dim", c.linear_key_head_dim},
      {"linear_num_value_heads", c.linear_num_value_heads}, {"linear_value_head_dim", c.linear_value_head_dim},
      {"vision.depth", c.vision ? c.vision->depth : 0}, {"vision.hidden_size", c.vision ? c.vision->hidden_size : 0},
      {"vision.intermediate_size", c.vision ? c.vision->intermediate_size : 0},
      {"audio.layers", c.audio ? c.audio->layers : 0}, {"audio.d_model", c.audio ? c.audio->d_model : 0},
      {"audio.ffn_dim", c.audio ? c.audio->ffn_dim : 0}, {"audio.conv_out_in", c.audio ? c.audio->conv_out_in : 0},
      {"audio.output_dim", c.audio ? c.audio->output_dim : 0}};
  for (const auto& [key, v] : sizes)
    if (v < 0 || v > (int64_t{1} << 24))
      throw_arg_error("lora::enumerate_modules", "config",
                      fmt::format("key '{}' must be in [0, 2^24] (got {})", key, v));
  if (c.num_layers < 0 || c.num_layers > kMaxPlanLayers || static_cast<int64_t>(c.layers.size()) != c.num_layers)
    throw_arg_error("lora::enumerate_modules", "config",
                    fmt::format("must have num_layers in [0, 16384] and one LayerSpec per layer (got {} and {})",
                                c.num_layers, c.layers.size()));
  std::vector<Module> out;
  constexpr auto kRep = TensorSplit::kReplicated;
  // Towers sit on the first stage; registration order of the HF thinker: audio, then vision.
  if (c.audio) {
    const AudioTower& a = *c.audio;
    if (a.conv_out_in > 0) out.push_back(make_module("audio_tower", "conv_out", ModulePart::kAudio, -1, a.conv_out_in, a.d_model, kRep));
    for (int64_t i = 0; i < a.layers; ++i) {
      std::string prefix = fmt::format("audio_tower.layers.{}", i);
      for (const char* proj : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"})
        out.push_back(make_module(prefix, proj, ModulePart::kAudio, i, a.d_model, a.d_model, kRep));
      out.push_back(make_module(prefix, "fc1", ModulePart::kAudio, i, a.d_model, a.ffn_dim, kRep));
      out.push_back(make_module(prefix, "fc2", ModulePart::kAudio, i, a.ffn_dim, a.d_model, kRep));
    }
    if (a.output_dim > 0) {
      out.push_back(make_module("audio_tower", "proj1", ModulePart::kAudio, -1, a.d_model, a.d_model, kRep));
      out.push_back(make_module("audio_tower", "proj2", ModulePart::kAudio, -1, a.d_model, a.output_dim, kRep));
    }
  }
  if (c.vision) {
    const VisionTower& v = *c.vision;
    for (int64_t i = 0; i < v.depth; ++i) {
      std::string prefix = fmt::format("visual.blocks.{}", i);
      out.push_back(make_module(prefix, "attn.qkv", ModulePart::kVision, i, v.hidden_size, 3 * v.hidden_size, kRep));
      out.push_back(make_module(prefix, "attn.proj", ModulePart::kVision, i, v.hidden_size, v.hidden_size, kRep));
      out.push_back(make_module(prefix, "mlp.linear_fc1", ModulePart::kVision, i, v.hidden_size, v.intermediate_size, kRep));
      out.push_back(make_module(prefix, "mlp.linear_fc2", ModulePart::kVision, i, v.intermediate_size, v.hidden_size, kRep));
    }
  }
  const int64_t h = c.hidden_size;
  const int64_t q_heads = c.attn_output_gate ? 2 * c.num_attention_heads : c.num_attention_heads;
  const int64_t kh_kd = c.linear_num_key_heads * c.linear_key_head_dim;
  const int64_t vh_vd = c.linear_num_value_heads * c.linear_value_head_dim;
  const int64_t vh = c.linear_num_value_heads;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const LayerSpec& layer = c.layers[static_cast<size_t>(i)];
    std::string prefix = fmt::format("decoder.layers.{}", i);
    auto add = [&](const char* local, int64_t in, int64_t out_f, TensorSplit split) -> Module& {
      out.push_back(make_module(prefix, local, ModulePart::kLanguage, i, in, out_f, split));
      return out.back();
    };
    if (layer.attention == AttentionKind::kFull) {
      add("self_attention.linear_qkv", h, (q_heads + 2 * c.num_key_value_heads) * c.head_dim, TensorSplit::kColumn);
      add("self_attention.linear_proj", c.num_attention_heads * c.head_dim, h, TensorSplit::kRow);
    } else if (c.linear_attention == LinearAttentionNaming::kQwen3_5) {
      // HF Gated DeltaNet modules inside Megatron: plain nn.Linear, not TP-split.
      add("self_attention.in_proj_qkv", h, 2 * kh_kd + vh_vd, kRep);
      add("self_attention.in_proj_z", h, vh_vd, kRep);
      add("self_attention.in_proj_b", h, vh, kRep);
      add("self_attention.in_proj_a", h, vh, kRep);
      add("self_attention.out_proj", vh_vd, h, kRep);
    } else {
      add("self_attention.in_proj_qkvz", h, 2 * kh_kd + 2 * vh_vd, kRep);
      add("self_attention.in_proj_ba", h, 2 * vh, kRep);
      add("self_attention.out_proj", vh_vd, h, kRep);
    }
    if (layer.mlp == MlpKind::kDense) {
      add("mlp.linear_fc1", h, 2 * c.intermediate_size, TensorSplit::kColumn);
      add("mlp.linear_fc2", c.intermediate_size, h, TensorSplit::kRow);
    } else {
      add("mlp.router", h, c.num_experts, kRep).router = true;
      // Expert tensor parallelism 1: routed experts are whole on each rank.
      add("mlp.experts.linear_fc1", h, 2 * c.moe_intermediate_size, kRep).grouped_experts = true;
      add("mlp.experts.linear_fc2", c.moe_intermediate_size, h, kRep).grouped_experts = true;
      if (c.shared_expert_intermediate_size > 0) {
        add("mlp.shared_experts.linear_fc1", h, 2 * c.shared_expert_intermediate_size, TensorSplit::kColumn);
        add("mlp.shared_experts.linear_fc2", c.shared_expert_intermediate_size, h, TensorSplit::kRow);
      }
    }
  }
  return out;
}

Plan plan(const ModelConfig& config, const PlanOptions& options) {
  const Parallel& par = options.parallel;
  // Limits (docs/lora.md): rank <= 2^20, each parallel size <= 2^16, at most 2^20 ranks.
  LEANSTEP_CHECK_ARG(options.lora_rank >= 1 && options.lora_rank <= kMaxLoraRank, kWhere, "lora_rank",
                     fmt::format("must be in [1, 2^20] (got {})", options.lora_rank));
  LEANSTEP_CHECK_ARG(par.tp >= 1 && par.tp <= kMaxParallel, kWhere, "tp", fmt::format("must be in [1, 65536] (got {})", par.tp));
  LEANSTEP_CHECK_ARG(par.pp >= 1 && par.pp <= kMaxParallel, kWhere, "pp", fmt::format("must be in [1, 65536] (got {})", par.pp));
  LEANSTEP_CHECK_ARG(par.ep >= 1 && par.ep <= kMaxParallel, kWhere, "ep", fmt::format("must be in [1, 65536] (got {})", par.ep));
  LEANSTEP_CHECK_ARG(par.tp * par.pp * par.ep <= kMaxRanks, kWhere, "tp",
                     fmt::format("x pp x ep must be at most 2^20 ranks (got {} x {} x {})", par.tp, par.pp, par.ep));
  LEANSTEP_CHECK_ARG(par.first_stage_layers >= -1, kWhere, "first_stage_layers",
                     fmt::format("must be >= 0, or -1 for the even split (got {})", par.first_stage_layers));
  LEANSTEP_CHECK_ARG(par.last_stage_layers >= -1, kWhere, "last_stage_layers",
                     fmt::format("must be >= 0, or -1 for the even split (got {})", par.last_stage_layers));
  LEANSTEP_CHECK_ARG(config.num_layers >= 0 && config.num_layers <= kMaxPlanLayers, kWhere, "config",
                     fmt::format("must have at most 16384 layers (got {})", config.num_layers));
  LEANSTEP_CHECK_ARG(config.num_experts >= 0 && config.num_experts <= kMaxPlanExperts, kWhere, "config",
                     fmt::format("must have at most 65536 experts (got {})", config.num_experts));
  LEANSTEP_CHECK_ARG(par.etp == 1, kWhere, "etp",
                     fmt::format("must be 1: expert tensor parallelism > 1 is not supported with LoRA on grouped "
                                 "experts (got {})", par.etp));
  LEANSTEP_CHECK_ARG(!options.targets.empty(), kWhere, "targets", "must not be empty");
  if (config.num_experts == 0)
    LEANSTEP_CHECK_ARG(par.ep == 1, kWhere, "ep", fmt::format("must be 1 for the dense model {} (got {})", config.model_type, par.ep));
  else
    LEANSTEP_CHECK_ARG(config.num_experts % par.ep == 0, kWhere, "ep",
                       fmt::format("must divide num_experts {} (got {})", config.num_experts, par.ep));

  Plan p;
  p.model_type = config.model_type;
  p.parallel = par;
  p.lora_rank = options.lora_rank;
  p.dtype = options.dtype;
  p.numbering = options.numbering;
  p.targets = options.targets;
  p.scope = options.scope;
  p.local_experts = config.num_experts / par.ep;
  p.all_modules = enumerate_modules(config);

  // Megatron splits attention by heads: TP must divide the query heads and the KV groups.
  bool has_attention = std::any_of(config.layers.begin(), config.layers.end(),
                                   [](const LayerSpec& l) { return l.attention == AttentionKind::kFull; });
  if (has_attention) {
    LEANSTEP_CHECK_ARG(config.num_attention_heads % par.tp == 0, kWhere, "tp",
                       fmt::format("must divide num_attention_heads {} (got {})", config.num_attention_heads, par.tp));
    LEANSTEP_CHECK_ARG(config.num_key_value_heads % par.tp == 0, kWhere, "tp",
                       fmt::format("must divide num_key_value_heads {} (got {})", config.num_key_value_heads, par.tp));
  }
  // TP must divide every split dimension of the base model (Megatron cannot build it otherwise).
  for (const Module& m : p.all_modules) {
    if (m.split == TensorSplit::kColumn && m.out_features % par.tp != 0)
      throw_arg_error(kWhere, "tp", fmt::format("must divide the output dim {} of column-parallel {} (got {})",
                                                m.out_features, m.name, par.tp));
    if (m.split == TensorSplit::kRow && m.in_features % par.tp != 0)
      throw_arg_error(kWhere, "tp", fmt::format("must divide the input dim {} of row-parallel {} (got {})",
                                                m.in_features, m.name, par.tp));
  }

  // Pipeline stages: even split unless first/last stage sizes are given.
  const int64_t L = config.num_layers;
  std::vector<int64_t> stage_layers(static_cast<size_t>(par.pp), 0);
  {
    bool first = par.first_stage_layers >= 0, last = par.last_stage_layers >= 0;
    if (par.pp == 1) {
      LEANSTEP_CHECK_ARG(!first && !last, kWhere, par.first_stage_layers >= 0 ? "first_stage_layers" : "last_stage_layers",
                         "can only be given with pp > 1");
      stage_layers[0] = L;
    } else {
      LEANSTEP_CHECK_ARG(par.first_stage_layers <= L && par.last_stage_layers <= L, kWhere,
                         par.first_stage_layers > L ? "first_stage_layers" : "last_stage_layers",
                         fmt::format("must not exceed num_hidden_layers {} (got {})", L,
                                     std::max(par.first_stage_layers, par.last_stage_layers)));
      int64_t rest = L - (first ? par.first_stage_layers : 0) - (last ? par.last_stage_layers : 0);
      int64_t middle = par.pp - (first ? 1 : 0) - (last ? 1 : 0);
      if (rest < 0)
        throw_arg_error(kWhere, "first_stage_layers",
                        fmt::format("plus last_stage_layers must not exceed num_hidden_layers {} (got {} + {})", L,
                                    std::max<int64_t>(par.first_stage_layers, 0), std::max<int64_t>(par.last_stage_layers, 0)));
      if (middle == 0) {
        if (rest != 0)
          throw_arg_error(kWhere, "first_stage_layers",
                          fmt::format("plus last_stage_layers must equal num_hidden_layers {} with pp 2 (got {} + {})", L,
                                      par.first_stage_layers, par.last_stage_layers));
      } else if (rest % middle != 0) {
        if (!first && !last)
          throw_arg_error(kWhere, "pp", fmt::format("must divide num_hidden_layers {} (got {}); or give first/last stage sizes",
                                                    L, par.pp));
        throw_arg_error(kWhere, "pp", fmt::format("stages other than the given first/last must split the remaining {} layers "
                                                  "evenly ({} stages, got {} layers)", rest, middle, rest));
      }
      for (int64_t s = 0; s < par.pp; ++s) {
        if (s == 0 && first) stage_layers[0] = par.first_stage_layers;
        else if (s == par.pp - 1 && last) stage_layers[static_cast<size_t>(s)] = par.last_stage_layers;
        else stage_layers[static_cast<size_t>(s)] = rest / middle;
      }
    }
  }

  // Target resolution.
  const bool towers_in_scope = options.scope == Scope::kAll;
  std::vector<char> adapted(p.all_modules.size(), 0);
  for (const std::string& target : options.targets) {
    LEANSTEP_CHECK_ARG(!target.empty(), kWhere, "targets", "must not contain an empty name");
    int64_t matched = 0;
    std::map<ModulePart, int64_t> out_of_scope;
    std::string out_of_scope_example;
    for (size_t i = 0; i < p.all_modules.size(); ++i) {
      const Module& m = p.all_modules[i];
      bool hit;
      if (target == kAllLinear) hit = !m.router;
      else if (target == kAllRouter) hit = m.router;
      else hit = suffix_matches(m.name, target);
      if (!hit) continue;
      if (m.part != ModulePart::kLanguage && !towers_in_scope) {
        if (out_of_scope[m.part]++ == 0 && out_of_scope_example.empty()) out_of_scope_example = name_pattern(m);
        continue;
      }
      adapted[i] = 1;
      ++matched;
    }
    std::string tower_counts;
    for (auto& [part, n] : out_of_scope)
      tower_counts += fmt::format("{}{} {} modules", tower_counts.empty() ? "" : ", ", n, part_name(part));
    if (matched == 0) {
      if (!out_of_scope.empty())
        throw_arg_error(kWhere, "targets",
                        fmt::format("entry '{}' matches only tower modules ({}, e.g. {}), which scope \"language\" "
                                    "leaves frozen; use scope \"all\" to adapt them", target, tower_counts,
                                    out_of_scope_example));
      throw_arg_error(kWhere, "targets",
                      fmt::format("entry '{}' matches no module of {} (names look like {})", target, config.model_type,
                                  p.all_modules.empty() ? "" : p.all_modules.back().name));
    }
    if (!out_of_scope.empty()) {
      if (target == kAllLinear)
        p.notes.push_back(fmt::format("scope language: the towers stay frozen ({} not adapted); scope all adds them",
                                      tower_counts));
      else
        p.notes.push_back(fmt::format("scope language: target '{}' would also match {} (e.g. {}) under scope all; "
                                      "they stay frozen", target, tower_counts, out_of_scope_example));
    }
  }

  // Per stage: adapted modules, shapes, layout.
  const int64_t r = options.lora_rank;
  int64_t next_layer = 0;
  p.stages.resize(static_cast<size_t>(par.pp));
  for (int64_t s = 0; s < par.pp; ++s) {
    StagePlan& st = p.stages[static_cast<size_t>(s)];
    st.pp_stage = s;
    st.first_layer = next_layer;
    st.num_layers = stage_layers[static_cast<size_t>(s)];
    next_layer += st.num_layers;
  }
  std::map<ModulePart, int64_t> tower_adapted;
  // Every size below is checked: a product that does not fit in int64 is an Error,
  // never a wrapped (wrong) count. The layout's length is bounded before it is built.
  const char* ovf = "the plan's parameter count";
  {
    std::vector<int64_t> stage_entries(static_cast<size_t>(par.pp), 0);
    for (size_t i = 0; i < p.all_modules.size(); ++i) {
      if (!adapted[i]) continue;
      const Module& m = p.all_modules[i];
      size_t s = 0;
      if (m.part == ModulePart::kLanguage)
        while (m.layer >= p.stages[s].first_layer + p.stages[s].num_layers) ++s;
      stage_entries[s] += 2 * (m.grouped_experts ? p.local_experts : 1);
      if (stage_entries[s] > kMaxStageTensors)
        throw_arg_error(kWhere, "config",
                        fmt::format("gives pipeline stage {} more than 2^22 = {} adapter tensors; use more pipeline "
                                    "stages or expert parallelism", s, kMaxStageTensors));
    }
  }
  for (size_t i = 0; i < p.all_modules.size(); ++i) {
    if (!adapted[i]) continue;
    const Module& m = p.all_modules[i];
    const int64_t copies_total = m.grouped_experts ? config.num_experts : 1;
    p.total_params = checked_add(
        p.total_params,
        checked_product({copies_total, r, checked_add(m.in_features, m.out_features, kWhere, ovf)}, kWhere, ovf), kWhere,
        ovf);
    ++p.total_modules;
    if (m.part != ModulePart::kLanguage) {
      ++p.adapted_tower_modules;
      ++tower_adapted[m.part];
    }
    // Stage: towers on the first; decoder layers by range.
    size_t s = 0;
    if (m.part == ModulePart::kLanguage)
      while (m.layer >= p.stages[s].first_layer + p.stages[s].num_layers) ++s;
    StagePlan& st = p.stages[s];

    AdaptedModule am;
    am.module = &m;
    am.copies = m.grouped_experts ? p.local_experts : 1;
    am.a_shape = {r, m.split == TensorSplit::kRow ? m.in_features / par.tp : m.in_features};
    am.b_shape = {m.split == TensorSplit::kColumn ? m.out_features / par.tp : m.out_features, r};
    am.params = checked_mul(am.copies,
                            checked_add(checked_mul(am.a_shape[0], am.a_shape[1], kWhere, ovf),
                                        checked_mul(am.b_shape[0], am.b_shape[1], kWhere, ovf), kWhere, ovf),
                            kWhere, ovf);

    std::string prefix = m.name;
    if (options.numbering == LayerNumbering::kLocal && m.part == ModulePart::kLanguage)
      prefix = fmt::format("decoder.layers.{}.{}", m.layer - st.first_layer, m.local_name);
    if (m.grouped_experts) {
      for (int64_t e = 0; e < am.copies; ++e)
        st.layout.push_back({fmt::format("{}.lora_A.weight{}", prefix, e), am.a_shape, options.dtype});
      for (int64_t e = 0; e < am.copies; ++e)
        st.layout.push_back({fmt::format("{}.lora_B.weight{}", prefix, e), am.b_shape, options.dtype});
    } else {
      st.layout.push_back({prefix + ".lora_A.weight", am.a_shape, options.dtype});
      st.layout.push_back({prefix + ".lora_B.weight", am.b_shape, options.dtype});
    }
    st.modules += 1;
    st.tensors += 2 * am.copies;
    st.params = checked_add(st.params, am.params, kWhere, ovf);
    st.adapted.push_back(std::move(am));
  }
  for (StagePlan& st : p.stages) st.memory_bytes = checked_mul(st.params, kOptimizerBytesPerParam, kWhere, "optimizer memory");
  if (towers_in_scope && p.adapted_tower_modules > 0) {
    std::string counts;
    for (auto& [part, n] : tower_adapted)
      counts += fmt::format("{}{} {} modules", counts.empty() ? "" : ", ", n, part_name(part));
    p.notes.push_back(fmt::format("scope all: tower modules are adapted too ({}), on pipeline stage 0", counts));
  }

  for (int64_t s = 0; s < par.pp; ++s)
    for (int64_t t = 0; t < par.tp; ++t)
      for (int64_t e = 0; e < par.ep; ++e) p.ranks.push_back({s, t, e, &p.stages[static_cast<size_t>(s)]});
  return p;
}

std::string plan_to_json(const Plan& p) {
  using nlohmann::json;
  // Plans of large models have millions of layout entries over all ranks; all
  // ranks of a stage share one layout, so each stage's text is built once.
  std::vector<std::string> stage_layout(p.stages.size());
  for (size_t s = 0; s < p.stages.size(); ++s) {
    std::string& text = stage_layout[s];
    text = "[";
    bool first = true;
    for (const TensorSpec& t : p.stages[s].layout) {
      if (!first) text += ",";
      first = false;
      // ordered_json keeps the documented key order {name, shape, dtype}.
      text += nlohmann::ordered_json{{"name", t.name}, {"shape", t.shape}, {"dtype", dtype_name(t.dtype)}}.dump();
    }
    text += "]";
  }
  std::string out = "{";
  out += "\"model_type\":" + json(p.model_type).dump();
  out += ",\"parallel\":" + json{{"tp", p.parallel.tp}, {"pp", p.parallel.pp}, {"ep", p.parallel.ep}}.dump();
  out += ",\"lora_rank\":" + json(p.lora_rank).dump();
  out += ",\"targets\":" + json(p.targets).dump();
  out += ",\"ranks\":[";
  for (size_t i = 0; i < p.ranks.size(); ++i) {
    const RankPlan& rk = p.ranks[i];
    const StagePlan& st = *rk.stage;
    if (i) out += ",";
    out += fmt::format(
        "{{\"pp_stage\":{},\"tp_rank\":{},\"ep_rank\":{},\"modules\":{},\"tensors\":{},\"params\":{},"
        "\"memory_bytes\":{},\"layout\":",
        rk.pp_stage, rk.tp_rank, rk.ep_rank, st.modules, st.tensors, st.params, st.memory_bytes);
    out += stage_layout[static_cast<size_t>(rk.pp_stage)];
    out += "}";
  }
  out += "]}";
  return out;
}

}  // namespace leanstep::lora
