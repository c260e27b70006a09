// LoRA coverage planner: from a Hugging Face config.json, a target list and a
// parallel layout to the adapted modules, trainable tensors, parameters,
// optimizer memory and gradient layout of every (PP stage, TP rank, EP rank).
//
// Rules (see docs/lora.md): a LoRA adapter on a linear of weight [out, in]
// adds lora_A [r, in] and lora_B [out, r]. Column-parallel bases split lora_B,
// row-parallel bases split lora_A; grouped expert linears get one A and one B
// per LOCAL expert (lora_A.weight0.., lora_B.weight0..).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "leanstep/core.h"

namespace leanstep::lora {

// ---------------------------------------------------------------- model config

enum class AttentionKind : uint8_t { kFull, kLinear };  // linear = Gated DeltaNet
enum class MlpKind : uint8_t { kDense, kMoE };

struct LayerSpec {
  AttentionKind attention = AttentionKind::kFull;
  MlpKind mlp = MlpKind::kDense;
};

// How the Gated DeltaNet projections are named and fused (HF implementation).
enum class LinearAttentionNaming : uint8_t {
  kNone,
  kQwen3_5,    // in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
  kQwen3Next,  // in_proj_qkvz, in_proj_ba, out_proj
};

// A ViT tower (Qwen3-Omni / Qwen3.5 vision encoder): blocks of
// attn.qkv, attn.proj, mlp.linear_fc1, mlp.linear_fc2 as plain linears.
struct VisionTower {
  int64_t depth = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
};

// The Qwen3-Omni audio encoder (Whisper-like): per layer self_attn.{q,k,v,out}_proj
// and fc1/fc2; conv_out, proj1 and proj2 around the layers when the config
// has the keys that size them (0 = not modelled).
struct AudioTower {
  int64_t layers = 0;
  int64_t d_model = 0;
  int64_t ffn_dim = 0;
  int64_t conv_out_in = 0;  // downsample_hidden_size * mel bins after three stride-2 convs
  int64_t output_dim = 0;
};

struct ModelConfig {
  std::string model_type;  // top-level model_type of the file
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  bool attn_output_gate = false;     // full-attention q doubled (Qwen3-Next, Qwen3.5)
  int64_t intermediate_size = 0;     // dense MLP layers (0 when the model has none)
  int64_t moe_intermediate_size = 0;
  int64_t num_experts = 0;           // 0 = dense model
  int64_t shared_expert_intermediate_size = 0;
  LinearAttentionNaming linear_attention = LinearAttentionNaming::kNone;
  int64_t linear_num_key_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_value_head_dim = 0;
  std::vector<LayerSpec> layers;     // one per decoder layer
  std::optional<VisionTower> vision;
  std::optional<AudioTower> audio;
};

// Reads a config.json. Errors name the file, the missing/bad key and the model_type.
// Supported model_type: llama, qwen3, qwen3_moe, qwen3_omni_moe, qwen3_5_moe, qwen3_next.
ModelConfig load_model_config(const std::string& path);
// Same from parsed JSON; `source` names it in error messages.
ModelConfig parse_model_config(const nlohmann::json& config, std::string_view source = "config");

// ---------------------------------------------------------------- modules

enum class ModulePart : uint8_t { kLanguage, kVision, kAudio };
// How the base weight is split over TP: column (output dim), row (input dim),
// or replicated (routers, HF-implemented Gated DeltaNet projections, towers,
// and routed experts, which with expert tensor parallelism 1 are never TP-split).
enum class TensorSplit : uint8_t { kColumn, kRow, kReplicated };

struct Module {
  std::string name;         // fully qualified, global layer index: "decoder.layers.3.self_attention.linear_qkv"
  std::string local_name;   // name inside its layer/block: "self_attention.linear_qkv"
  ModulePart part = ModulePart::kLanguage;
  int64_t layer = -1;       // decoder layer (global), tower block index, or -1
  int64_t in_features = 0;
  int64_t out_features = 0;
  TensorSplit split = TensorSplit::kReplicated;
  bool grouped_experts = false;  // mlp.experts.linear_fc1/fc2: one module for all experts
  bool router = false;           // mlp.router (TopKRouter, not a linear)
};

// Every adaptable module of the model (language model, then towers as the
// config describes them), in registration order: towers first (they sit on the
// first pipeline stage), then decoder layers. Embedding and output layer are not listed.
std::vector<Module> enumerate_modules(const ModelConfig& config);

// ---------------------------------------------------------------- planning

enum class Scope : uint8_t { kLanguage, kAll };
// Layer index in tensor names under PP: global (as in distributed checkpoints)
// or local to the stage (as named_parameters() prints on a pipeline rank).
enum class LayerNumbering : uint8_t { kGlobal, kLocal };

struct Parallel {
  int64_t tp = 1;
  int64_t pp = 1;
  int64_t ep = 1;
  int64_t etp = 1;                 // expert tensor parallelism: only 1 is supported
  int64_t first_stage_layers = -1; // -1 = even split
  int64_t last_stage_layers = -1;
};

inline constexpr const char* kAllLinear = "all-linear";
inline constexpr const char* kAllRouter = "all-router";

struct PlanOptions {
  // Name suffixes matched at '.' boundaries against fully qualified module
  // names, and/or the keywords "all-linear" and "all-router".
  std::vector<std::string> targets{kAllLinear};
  int64_t lora_rank = 32;
  Scope scope = Scope::kLanguage;
  Parallel parallel{};
  DType dtype = DType::kBFloat16;  // adapter parameter dtype
  LayerNumbering numbering = LayerNumbering::kGlobal;
};

struct TensorSpec {
  std::string name;  // "decoder.layers.0.self_attention.linear_qkv.lora_A.weight"
  std::vector<int64_t> shape;
  DType dtype = DType::kBFloat16;
  int64_t numel() const;
  bool operator==(const TensorSpec&) const = default;
};

// True for the per-expert tensors of grouped expert modules ("….mlp.experts.….weight<i>"):
// they are expert-parallel and go into the expert gradient buffer (layout::ParamSpec::is_expert).
bool is_expert_tensor(std::string_view name);

inline constexpr int64_t kOptimizerBytesPerParam = 16;  // fp32 grad + fp32 master + 2 fp32 Adam moments

// One adapted module on a rank: its adapter shapes after the TP split.
struct AdaptedModule {
  const Module* module = nullptr;  // points into Plan::all_modules
  std::vector<int64_t> a_shape;    // lora_A [r, in or in/TP]
  std::vector<int64_t> b_shape;    // lora_B [out or out/TP, r]
  int64_t copies = 1;              // local experts for grouped modules, else 1
  int64_t params = 0;              // copies * (numel(A) + numel(B))
};

// Everything one pipeline stage trains. All TP and EP ranks of a stage have the
// same names, shapes and dtypes (TP splits and local expert counts are uniform).
struct StagePlan {
  int64_t pp_stage = 0;
  int64_t first_layer = 0;   // global index of the stage's first decoder layer
  int64_t num_layers = 0;
  int64_t modules = 0;       // adapted modules (a grouped expert module counts once)
  int64_t tensors = 0;
  int64_t params = 0;
  int64_t memory_bytes = 0;  // params * kOptimizerBytesPerParam
  std::vector<TensorSpec> layout;  // registration order
  std::vector<AdaptedModule> adapted;  // registration order
};

struct RankPlan {
  int64_t pp_stage = 0;
  int64_t tp_rank = 0;
  int64_t ep_rank = 0;
  const StagePlan* stage = nullptr;  // its counts and layout
  const std::vector<TensorSpec>& layout() const { return stage->layout; }
};

struct Plan {
  std::string model_type;
  Parallel parallel;
  int64_t lora_rank = 0;
  DType dtype = DType::kBFloat16;  // adapter parameter dtype
  LayerNumbering numbering = LayerNumbering::kGlobal;
  std::vector<std::string> targets;
  Scope scope = Scope::kLanguage;
  int64_t local_experts = 0;
  std::vector<Module> all_modules;  // enumerate_modules(config)
  std::vector<StagePlan> stages;    // one per PP stage
  std::vector<RankPlan> ranks;      // (pp_stage, tp_rank, ep_rank), ep fastest
  // Model-wide unique trainable parameters (every expert, unsplit tensors).
  int64_t total_params = 0;
  int64_t total_modules = 0;
  int64_t adapted_tower_modules = 0;  // > 0 only with scope all
  // Things a user must see: which suffixes would match tower modules under
  // scope "all", which tower modules scope "all" adds, ...
  std::vector<std::string> notes;

  Plan() = default;
  Plan(const Plan&) = delete;  // ranks point into stages
  Plan& operator=(const Plan&) = delete;
  Plan(Plan&&) = default;
  Plan& operator=(Plan&&) = default;
};

// Plans the adapters. Rejects ETP > 1, sizes that do not divide (TP over the
// split dims, EP over experts, PP over layers) and targets that match nothing.
Plan plan(const ModelConfig& config, const PlanOptions& options);

// The `leanstep lora plan --json` object: {model_type, parallel{tp,pp,ep},
// lora_rank, targets, ranks[{pp_stage, tp_rank, ep_rank, modules, tensors,
// params, memory_bytes, layout[{name, shape, dtype}]}]}, compact, one line.
std::string plan_to_json(const Plan& plan);

// The `leanstep lora plan` report for people: the settings, one table per
// distinct stage shape (module patterns, adapter shapes, counts), per-rank
// totals with optimizer memory, and the model totals. `source` names the
// config in the title.
std::string format_plan(const Plan& plan, std::string_view source);

// ---------------------------------------------------------------- diff

// One rank's trainable tensors as read from a plan or a framework dump.
struct RankLayout {
  int64_t pp_stage = 0;
  int64_t tp_rank = 0;
  int64_t ep_rank = 0;
  std::vector<TensorSpec> layout;
};

// Reads `ranks[].layout` from a plan or a dump ({"ranks": [...]} or a bare list
// of ranks; missing pp_stage/tp_rank/ep_rank read as 0; dtypes like
// "torch.bfloat16", "bf16" or "bfloat16"). `source` names it in errors.
std::vector<RankLayout> read_rank_layouts(const nlohmann::json& doc, std::string_view source);
std::vector<RankLayout> load_rank_layouts(const std::string& path);

struct LayoutDiff {
  // Readable lines: per group of ranks with the same differences, a "rank (...)" head line,
  // then at most `max_lines_per_rank` indented differences (then one "... N more" line).
  std::vector<std::string> differences;
  // One line per (kind, name pattern) over all ranks, layer and expert indices as '*':
  // "only in B: decoder.layers.*.self_attention.linear_proj.lora_A.weight x 96".
  std::vector<std::string> summary;
  int64_t count = 0;           // all differences found, printed or not
  int64_t ranks_compared = 0;  // ranks in either input
  int64_t ranks_differing = 0;
  bool identical() const { return count == 0; }
};

// Compares rank by rank (missing ranks, renamed/missing/extra tensors,
// changed shapes and dtypes, changed registration order). `count` counts every
// difference of every rank; ranks with the same differences print once.
LayoutDiff diff_layouts(const std::vector<RankLayout>& a, const std::vector<RankLayout>& b,
                        std::string_view a_label = "A", std::string_view b_label = "B",
                        int64_t max_lines_per_rank = 20);

const char* scope_name(Scope scope);
Scope scope_from_name(std::string_view name);

}  // namespace leanstep::lora
