// LoRA coverage planner: hand-computed counts on small synthetic configs (one
// rule at a time), the real configs in examples/models, errors, and diff.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "leanstep/lora.h"
#include "test_util.h"

namespace lora = leanstep::lora;
using nlohmann::json;

namespace {

std::string model_path(const std::string& file) {
  return std::string(LEANSTEP_SOURCE_DIR) + "/examples/models/" + file;
}

const std::vector<std::string> kRealConfigs = {
    "qwen3-30b-a3b.config.json", "qwen3-omni-30b-a3b-instruct.config.json", "qwen3.5-35b-a3b.config.json",
    "qwen3-next-80b-a3b-instruct.config.json"};

// llama: hidden 64, 2 layers, 4 heads, 2 kv heads, head_dim defaults to 64/4 = 16, ffn 96.
json tiny_llama() {
  return {{"model_type", "llama"}, {"hidden_size", 64}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
          {"num_key_value_heads", 2}, {"intermediate_size", 96}};
}

// qwen3_moe: hidden 32, heads 2, kv 2, head_dim 8 (qkv 32 -> 48); 4 layers; layer i is MoE when (i+1) % 2 == 0 and i not in mlp_only_layers [3]:
// only layer 1 is MoE; layers 0, 2, 3 are dense (intermediate_size 48).
json tiny_moe() {
  return {{"model_type", "qwen3_moe"}, {"hidden_size", 32}, {"num_hidden_layers", 4}, {"num_attention_heads", 2},
          {"num_key_value_heads", 2}, {"head_dim", 8}, {"intermediate_size", 48}, {"moe_intermediate_size", 16},
          {"num_experts", 4}, {"decoder_sparse_step", 2}, {"mlp_only_layers", {3}}};
}

// qwen3_5_moe text config: hidden 32, 4 layers (linear x3, full), heads 2, kv 2, head_dim 8,
// Kh 2, Kd 4, Vh 4, Vd 4, 4 experts of 8, shared expert of 8.
json tiny_qwen3_5_text() {
  return {{"hidden_size", 32}, {"num_hidden_layers", 4},
          {"layer_types", {"linear_attention", "linear_attention", "linear_attention", "full_attention"}},
          {"num_attention_heads", 2}, {"num_key_value_heads", 2}, {"head_dim", 8}, {"attn_output_gate", true},
          {"linear_num_key_heads", 2}, {"linear_key_head_dim", 4}, {"linear_num_value_heads", 4},
          {"linear_value_head_dim", 4}, {"num_experts", 4}, {"moe_intermediate_size", 8},
          {"shared_expert_intermediate_size", 8}};
}
json tiny_qwen3_5() { return {{"model_type", "qwen3_5_moe"}, {"text_config", tiny_qwen3_5_text()}}; }

json tiny_qwen3_next() {
  json c = tiny_qwen3_5_text();
  c.erase("layer_types");
  c.erase("attn_output_gate");
  c["full_attention_interval"] = 4;
  c["model_type"] = "qwen3_next";
  return c;
}

// qwen3_omni_moe: thinker text = tiny_moe dims (all layers MoE), vision 2 blocks (16 -> 24),
// audio 1 layer (d_model 8, ffn 16, output_dim 32; no downsample keys -> no conv_out).
json tiny_omni() {
  json text = tiny_moe();
  text.erase("model_type");
  text["decoder_sparse_step"] = 1;
  text["mlp_only_layers"] = json::array();
  return {{"model_type", "qwen3_omni_moe"},
          {"thinker_config",
           {{"text_config", text},
            {"vision_config", {{"depth", 2}, {"hidden_size", 16}, {"intermediate_size", 24}}},
            {"audio_config", {{"encoder_layers", 1}, {"d_model", 8}, {"encoder_ffn_dim", 16}, {"output_dim", 32}}}}}};
}

lora::PlanOptions options(std::vector<std::string> targets, int64_t r, lora::Parallel par = {},
                          lora::Scope scope = lora::Scope::kLanguage) {
  lora::PlanOptions o;
  o.targets = std::move(targets);
  o.lora_rank = r;
  o.parallel = par;
  o.scope = scope;
  return o;
}

lora::Plan plan_of(const json& config, const lora::PlanOptions& o) {
  return lora::plan(lora::parse_model_config(config, "test"), o);
}

const lora::TensorSpec* find_tensor(const lora::StagePlan& st, const std::string& name) {
  for (const auto& t : st.layout)
    if (t.name == name) return &t;
  return nullptr;
}

std::set<std::string> adapted_names(const lora::Plan& p) {
  std::set<std::string> out;
  for (const auto& st : p.stages)
    for (const auto& am : st.adapted) out.insert(am.module->name);
  return out;
}

}  // namespace

// ---------------------------------------------------------------- dense rules, TP

TEST(LoraPlan, DenseAllLinearCountsByHand) {
  // Per layer, r = 4: linear_qkv 64 -> (4 + 2*2) * 16 = 128: 4 * (64 + 128) = 768;
  // linear_proj 64 -> 64: 512; linear_fc1 64 -> 192: 1024; linear_fc2 96 -> 64: 640. Sum 2944.
  lora::Plan p = plan_of(tiny_llama(), options({"all-linear"}, 4));
  ASSERT_EQ(p.ranks.size(), 1u);
  const auto& st = p.stages[0];
  EXPECT_EQ(st.modules, 8);
  EXPECT_EQ(st.tensors, 16);
  EXPECT_EQ(st.params, 2 * 2944);
  EXPECT_EQ(st.memory_bytes, 16 * 2 * 2944);
  EXPECT_EQ(p.total_params, 2 * 2944);
  ASSERT_EQ(st.layout.size(), 16u);
  // Registration order: qkv A, qkv B, proj A, proj B, fc1 A, fc1 B, fc2 A, fc2 B per layer.
  EXPECT_EQ(st.layout[0].name, "decoder.layers.0.self_attention.linear_qkv.lora_A.weight");
  EXPECT_EQ(st.layout[0].shape, (std::vector<int64_t>{4, 64}));
  EXPECT_EQ(st.layout[1].name, "decoder.layers.0.self_attention.linear_qkv.lora_B.weight");
  EXPECT_EQ(st.layout[1].shape, (std::vector<int64_t>{128, 4}));
  EXPECT_EQ(st.layout[7].name, "decoder.layers.0.mlp.linear_fc2.lora_B.weight");
  EXPECT_EQ(st.layout[8].name, "decoder.layers.1.self_attention.linear_qkv.lora_A.weight");
  EXPECT_EQ(st.layout[0].dtype, leanstep::DType::kBFloat16);
}

TEST(LoraPlan, TensorParallelSplitsColumnBAndRowA) {
  // TP 2: column (qkv, fc1) split lora_B's rows, row (proj, fc2) split lora_A's columns.
  // qkv A [4,64] B [64,4] = 512; proj A [4,32] B [64,4] = 384; fc1 A [4,64] B [96,4] = 640;
  // fc2 A [4,48] B [64,4] = 448. Per layer 1984.
  lora::Plan p = plan_of(tiny_llama(), options({"all-linear"}, 4, {.tp = 2}));
  ASSERT_EQ(p.ranks.size(), 2u);
  const auto& st = p.stages[0];
  EXPECT_EQ(st.params, 2 * 1984);
  EXPECT_EQ(find_tensor(st, "decoder.layers.1.self_attention.linear_qkv.lora_B.weight")->shape,
            (std::vector<int64_t>{64, 4}));
  EXPECT_EQ(find_tensor(st, "decoder.layers.1.self_attention.linear_qkv.lora_A.weight")->shape,
            (std::vector<int64_t>{4, 64}));
  EXPECT_EQ(find_tensor(st, "decoder.layers.1.self_attention.linear_proj.lora_A.weight")->shape,
            (std::vector<int64_t>{4, 32}));
  EXPECT_EQ(find_tensor(st, "decoder.layers.1.self_attention.linear_proj.lora_B.weight")->shape,
            (std::vector<int64_t>{64, 4}));
  EXPECT_EQ(find_tensor(st, "decoder.layers.0.mlp.linear_fc1.lora_B.weight")->shape, (std::vector<int64_t>{96, 4}));
  EXPECT_EQ(find_tensor(st, "decoder.layers.0.mlp.linear_fc2.lora_A.weight")->shape, (std::vector<int64_t>{4, 48}));
  // The model-wide count is independent of TP.
  EXPECT_EQ(p.total_params, 2 * 2944);
  EXPECT_EQ(p.ranks[1].tp_rank, 1);
  EXPECT_EQ(&p.ranks[1].layout(), &st.layout);
}

TEST(LoraPlan, SuffixMatchingAtDotBoundaries) {
  json cfg = tiny_qwen3_5();
  auto names = [&](std::vector<std::string> t) { return adapted_names(plan_of(cfg, options(std::move(t), 2))); };
  // "linear_fc1" hits routed and shared experts of every layer.
  EXPECT_EQ(names({"linear_fc1"}).size(), 8u);
  // "experts.linear_fc1" must not hit "shared_experts.linear_fc1".
  auto routed = names({"experts.linear_fc1"});
  EXPECT_EQ(routed.size(), 4u);
  for (const auto& n : routed) EXPECT_EQ(n.find("shared"), std::string::npos) << n;
  EXPECT_EQ(names({"shared_experts.linear_fc1"}).size(), 4u);
  // A fully qualified name is its own suffix: one module.
  EXPECT_EQ(names({"decoder.layers.3.self_attention.linear_qkv"}),
            (std::set<std::string>{"decoder.layers.3.self_attention.linear_qkv"}));
  // "fc1" is not a dot-bounded suffix of "linear_fc1".
  EXPECT_LEANSTEP_ERROR(names({"fc1"}), "'fc1' matches no module");
  EXPECT_LEANSTEP_ERROR(names({"linear_qvk"}), "'linear_qvk' matches no module of qwen3_5_moe");
  // Routers only when asked for.
  for (const auto& n : names({"all-linear"})) EXPECT_EQ(n.find("router"), std::string::npos) << n;
  EXPECT_EQ(names({"all-router"}).size(), 4u);
  EXPECT_EQ(names({"router"}).size(), 4u);
  EXPECT_EQ(names({"all-linear", "all-router"}).size(), names({"all-linear"}).size() + 4);
}

// ---------------------------------------------------------------- MoE, EP

TEST(LoraPlan, MoeLayerSelectionAndGroupedExperts) {
  lora::ModelConfig c = lora::parse_model_config(tiny_moe(), "test");
  ASSERT_EQ(c.layers.size(), 4u);
  EXPECT_EQ(c.layers[0].mlp, lora::MlpKind::kDense);
  EXPECT_EQ(c.layers[1].mlp, lora::MlpKind::kMoE);
  EXPECT_EQ(c.layers[2].mlp, lora::MlpKind::kDense);
  EXPECT_EQ(c.layers[3].mlp, lora::MlpKind::kDense);  // mlp_only_layers

  // experts.linear_fc1 of layer 1: 32 -> 32 per expert, r = 2: 2 * (32 + 32) = 128 per expert.
  lora::Plan p = lora::plan(c, options({"experts.linear_fc1"}, 2));
  const auto& st = p.stages[0];
  EXPECT_EQ(st.modules, 1);
  EXPECT_EQ(st.tensors, 8);
  EXPECT_EQ(st.params, 4 * 128);
  std::vector<std::string> expected = {
      "decoder.layers.1.mlp.experts.linear_fc1.lora_A.weight0", "decoder.layers.1.mlp.experts.linear_fc1.lora_A.weight1",
      "decoder.layers.1.mlp.experts.linear_fc1.lora_A.weight2", "decoder.layers.1.mlp.experts.linear_fc1.lora_A.weight3",
      "decoder.layers.1.mlp.experts.linear_fc1.lora_B.weight0", "decoder.layers.1.mlp.experts.linear_fc1.lora_B.weight1",
      "decoder.layers.1.mlp.experts.linear_fc1.lora_B.weight2", "decoder.layers.1.mlp.experts.linear_fc1.lora_B.weight3"};
  ASSERT_EQ(st.layout.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(st.layout[i].name, expected[i]);
  EXPECT_EQ(st.layout[0].shape, (std::vector<int64_t>{2, 32}));
  EXPECT_EQ(st.layout[4].shape, (std::vector<int64_t>{32, 2}));

  // "linear_fc1" covers the dense layers' mlp.linear_fc1 (32 -> 96) too: 3 * 2 * (32 + 96) = 768.
  lora::Plan q = lora::plan(c, options({"linear_fc1"}, 2));
  EXPECT_EQ(q.stages[0].modules, 4);
  EXPECT_EQ(q.stages[0].params, 4 * 128 + 768);

  // Router: TopKRouter [4, 32] -> A [2, 32], B [4, 2] = 72; not TP-split.
  lora::Plan rt = lora::plan(c, options({"all-router"}, 2, {.tp = 2}));
  EXPECT_EQ(rt.stages[0].params, 72);
  EXPECT_EQ(rt.stages[0].layout[1].name, "decoder.layers.1.mlp.router.lora_B.weight");
  EXPECT_EQ(rt.stages[0].layout[1].shape, (std::vector<int64_t>{4, 2}));
}

TEST(LoraPlan, ExpertParallelLocalExperts) {
  lora::ModelConfig c = lora::parse_model_config(tiny_moe(), "test");
  // EP 2: 2 local experts per rank, named weight0/weight1 on every EP rank; TP does not split them.
  lora::Plan p = lora::plan(c, options({"experts.linear_fc1", "linear_qkv"}, 2, {.tp = 2, .ep = 2}));
  ASSERT_EQ(p.ranks.size(), 4u);  // (tp, ep) = (0,0) (0,1) (1,0) (1,1), ep fastest
  EXPECT_EQ(p.ranks[1].tp_rank, 0);
  EXPECT_EQ(p.ranks[1].ep_rank, 1);
  EXPECT_EQ(p.local_experts, 2);
  const auto& st = p.stages[0];
  // qkv: 4 layers * (A [2,32] + B [(2+4)*8/2 = 24, 2]) = 4 * 112 = 448; experts 2 * 128 = 256.
  EXPECT_EQ(st.params, 448 + 256);
  EXPECT_EQ(st.tensors, 8 + 4);
  EXPECT_NE(find_tensor(st, "decoder.layers.1.mlp.experts.linear_fc1.lora_B.weight1"), nullptr);
  EXPECT_EQ(find_tensor(st, "decoder.layers.1.mlp.experts.linear_fc1.lora_B.weight2"), nullptr);
  EXPECT_EQ(find_tensor(st, "decoder.layers.1.mlp.experts.linear_fc1.lora_B.weight1")->shape,
            (std::vector<int64_t>{32, 2}));
  int64_t expert_tensors = 0;
  for (const auto& t : st.layout) expert_tensors += lora::is_expert_tensor(t.name);
  EXPECT_EQ(expert_tensors, 4);
  EXPECT_FALSE(lora::is_expert_tensor("decoder.layers.0.mlp.shared_experts.linear_fc1.lora_A.weight"));
  EXPECT_FALSE(lora::is_expert_tensor("decoder.layers.0.mlp.router.lora_A.weight"));
  // Model-wide (unsplit, all 4 experts): qkv 4 layers * 2 * (32 + 48) = 640; experts 4 * 128 = 512.
  EXPECT_EQ(p.total_params, 640 + 512);
}

TEST(LoraPlan, ParallelSizeErrors) {
  lora::ModelConfig c = lora::parse_model_config(tiny_moe(), "test");
  EXPECT_LEANSTEP_ERROR(lora::plan(c, options({"all-linear"}, 2, {.ep = 3})), "argument 'ep' must divide num_experts 4");
  EXPECT_LEANSTEP_ERROR(lora::plan(c, options({"all-linear"}, 2, {.etp = 2})),
                        "expert tensor parallelism > 1 is not supported");
  EXPECT_LEANSTEP_ERROR(lora::plan(c, options({"all-linear"}, 2, {.tp = 4})), "argument 'tp' must divide num_attention_heads 2");
  json gqa = tiny_llama();  // 4 heads, 2 KV groups
  EXPECT_LEANSTEP_ERROR(plan_of(gqa, options({"all-linear"}, 2, {.tp = 4})), "argument 'tp' must divide num_key_value_heads 2");
  // Heads divide but the MLP does not: fc1 out 180 splits over 4, fc2 in 90 does not.
  json mlp = tiny_llama();
  mlp["num_key_value_heads"] = 4;
  mlp["intermediate_size"] = 90;
  EXPECT_LEANSTEP_ERROR(plan_of(mlp, options({"all-linear"}, 2, {.tp = 4})),
                        "argument 'tp' must divide the input dim 90 of row-parallel decoder.layers.0.mlp.linear_fc2 (got 4)");
  EXPECT_LEANSTEP_ERROR(lora::plan(c, options({"all-linear"}, 2, {.pp = 3})), "argument 'pp' must divide num_hidden_layers 4");
  EXPECT_LEANSTEP_ERROR(lora::plan(c, options({"all-linear"}, 0)), "argument 'lora_rank' must be in [1, 2^20] (got 0)");
  EXPECT_LEANSTEP_ERROR(lora::plan(c, options({"all-linear"}, 2, {.tp = 0})), "argument 'tp' must be in [1, 65536] (got 0)");
  EXPECT_LEANSTEP_ERROR(lora::plan(c, options({}, 2)), "argument 'targets' must not be empty");
  EXPECT_LEANSTEP_ERROR(lora::plan(c, options({"all-linear"}, 2, {.pp = 2, .first_stage_layers = 1, .last_stage_layers = 2})),
                        "must equal num_hidden_layers 4");
  EXPECT_LEANSTEP_ERROR(lora::plan(c, options({"all-linear"}, 2, {.pp = 1, .first_stage_layers = 2})),
                        "can only be given with pp > 1");
  EXPECT_LEANSTEP_ERROR(lora::plan(c, options({"all-linear"}, 2, {.pp = 2, .first_stage_layers = 5})),
                        "must not exceed num_hidden_layers 4");
  EXPECT_LEANSTEP_ERROR(plan_of(tiny_llama(), options({"all-linear"}, 2, {.ep = 2})),
                        "argument 'ep' must be 1 for the dense model llama");
  // A model without full attention (all Gated DeltaNet) has no head rule, only the split dims.
  json gdn = tiny_qwen3_next();
  gdn["full_attention_interval"] = 5;  // > 4 layers: no full-attention layer
  // Shared expert fc1 out 16 splits over 16; fc2 in 8 does not.
  EXPECT_LEANSTEP_ERROR(plan_of(gdn, options({"all-linear"}, 2, {.tp = 16})),
                        "must divide the input dim 8 of row-parallel decoder.layers.0.mlp.shared_experts.linear_fc2");
}

// ---------------------------------------------------------------- hybrid, gate, shared experts

TEST(LoraPlan, Qwen3_5HybridLayersGateAndSharedExperts) {
  lora::ModelConfig c = lora::parse_model_config(tiny_qwen3_5(), "test");
  EXPECT_EQ(c.layers[0].attention, lora::AttentionKind::kLinear);
  EXPECT_EQ(c.layers[3].attention, lora::AttentionKind::kFull);
  EXPECT_TRUE(c.attn_output_gate);
  // r = 2. Linear-attention layer: in_proj_qkv 32 -> 2*2*4 + 4*4 = 32: 128; in_proj_z 32 -> 16: 96;
  // in_proj_b 32 -> 4: 72; in_proj_a: 72; out_proj 16 -> 32: 96. Sum 464.
  // Full layer (gated): linear_qkv 32 -> (2*2 + 2*2) * 8 = 64: 192; linear_proj 16 -> 32: 96. Sum 288.
  // MoE (every layer): experts fc1 4 * 2 * (32 + 16) = 384, fc2 4 * 2 * (8 + 32) = 320,
  // shared fc1 2 * (32 + 16) = 96, shared fc2 2 * (8 + 32) = 80. Sum 880.
  lora::Plan p = lora::plan(c, options({"all-linear"}, 2));
  EXPECT_EQ(p.stages[0].params, 3 * 464 + 288 + 4 * 880);
  EXPECT_EQ(p.stages[0].modules, 3 * 5 + 2 + 4 * 4);
  EXPECT_EQ(p.stages[0].tensors, 2 * (3 * 5 + 2 + 4 * 2) + 4 * 2 * 2 * 4);
  const auto& st = p.stages[0];
  // Registration order inside a linear layer, then the MoE: router (not adapted), experts, shared experts.
  EXPECT_EQ(st.layout[0].name, "decoder.layers.0.self_attention.in_proj_qkv.lora_A.weight");
  EXPECT_EQ(st.layout[2].name, "decoder.layers.0.self_attention.in_proj_z.lora_A.weight");
  EXPECT_EQ(st.layout[4].name, "decoder.layers.0.self_attention.in_proj_b.lora_A.weight");
  EXPECT_EQ(st.layout[6].name, "decoder.layers.0.self_attention.in_proj_a.lora_A.weight");
  EXPECT_EQ(st.layout[8].name, "decoder.layers.0.self_attention.out_proj.lora_A.weight");
  EXPECT_EQ(st.layout[10].name, "decoder.layers.0.mlp.experts.linear_fc1.lora_A.weight0");
  EXPECT_EQ(st.layout[26].name, "decoder.layers.0.mlp.shared_experts.linear_fc1.lora_A.weight");
  EXPECT_EQ(find_tensor(st, "decoder.layers.3.self_attention.linear_qkv.lora_B.weight")->shape,
            (std::vector<int64_t>{64, 2}));
  EXPECT_EQ(find_tensor(st, "decoder.layers.0.self_attention.in_proj_b.lora_B.weight")->shape,
            (std::vector<int64_t>{4, 2}));

  // Without the gate, q is not doubled: 32 -> (2 + 4) * 8 = 48: 2 * (32 + 48) = 160.
  json no_gate = tiny_qwen3_5();
  no_gate["text_config"]["attn_output_gate"] = false;
  lora::Plan g = plan_of(no_gate, options({"linear_qkv"}, 2));
  EXPECT_EQ(g.stages[0].params, 160);

  // TP 2: shared experts split (fc1 B [8, 2], fc2 A [2, 4]); Gated DeltaNet projections and
  // routed experts are not TP-split.
  lora::Plan t = lora::plan(c, options({"all-linear"}, 2, {.tp = 2}));
  const auto& ts = t.stages[0];
  EXPECT_EQ(find_tensor(ts, "decoder.layers.0.mlp.shared_experts.linear_fc1.lora_B.weight")->shape,
            (std::vector<int64_t>{8, 2}));
  EXPECT_EQ(find_tensor(ts, "decoder.layers.0.mlp.shared_experts.linear_fc2.lora_A.weight")->shape,
            (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(find_tensor(ts, "decoder.layers.0.self_attention.in_proj_qkv.lora_B.weight")->shape,
            (std::vector<int64_t>{32, 2}));
  EXPECT_EQ(find_tensor(ts, "decoder.layers.0.mlp.experts.linear_fc1.lora_B.weight3")->shape,
            (std::vector<int64_t>{16, 2}));
  // Saved per rank by the split: shared fc1 B 16 -> 8 rows (-16 per layer), shared fc2 A 8 -> 4
  // columns (-8 per layer), linear_qkv B 64 -> 32 rows (-64), linear_proj A 16 -> 8 columns (-16).
  EXPECT_EQ(ts.params, p.stages[0].params - 4 * (16 + 8) - 64 - 16);
}

TEST(LoraPlan, Qwen3NextIntervalAndFusedProjections) {
  lora::ModelConfig c = lora::parse_model_config(tiny_qwen3_next(), "test");
  for (int i = 0; i < 3; ++i) EXPECT_EQ(c.layers[i].attention, lora::AttentionKind::kLinear);
  EXPECT_EQ(c.layers[3].attention, lora::AttentionKind::kFull);
  EXPECT_TRUE(c.attn_output_gate);  // Qwen3-Next always gates; no key in its config
  // in_proj_qkvz 32 -> 2*8 + 2*16 = 48: 2 * (32 + 48) = 160; in_proj_ba 32 -> 8: 80; out_proj: 96.
  lora::Plan p = lora::plan(c, options({"in_proj_qkvz", "in_proj_ba", "out_proj"}, 2));
  EXPECT_EQ(p.stages[0].params, 3 * (160 + 80 + 96));
  EXPECT_EQ(p.stages[0].modules, 9);
  lora::Plan all = lora::plan(c, options({"all-linear"}, 2));
  EXPECT_EQ(all.stages[0].params, 3 * 336 + 288 + 4 * 880);
  // The Qwen3.5 names do not exist in Qwen3-Next.
  EXPECT_LEANSTEP_ERROR(lora::plan(c, options({"in_proj_z"}, 2)), "'in_proj_z' matches no module of qwen3_next");
}

// ---------------------------------------------------------------- PP

TEST(LoraPlan, PipelineStagesEvenAndGiven) {
  lora::ModelConfig c = lora::parse_model_config(tiny_moe(), "test");
  lora::Plan p = lora::plan(c, options({"linear_qkv"}, 2, {.pp = 2}));
  ASSERT_EQ(p.stages.size(), 2u);
  EXPECT_EQ(p.stages[1].first_layer, 2);
  EXPECT_EQ(p.stages[1].num_layers, 2);
  EXPECT_EQ(p.stages[1].layout[0].name, "decoder.layers.2.self_attention.linear_qkv.lora_A.weight");
  // 2 * (32 + 48) = 160 per layer.
  EXPECT_EQ(p.stages[0].params, 320);
  EXPECT_EQ(p.stages[1].params, 320);

  lora::PlanOptions local = options({"linear_qkv"}, 2, {.pp = 2});
  local.numbering = lora::LayerNumbering::kLocal;
  lora::Plan l = lora::plan(c, local);
  EXPECT_EQ(l.stages[1].layout[0].name, "decoder.layers.0.self_attention.linear_qkv.lora_A.weight");
  EXPECT_EQ(l.stages[1].layout[2].name, "decoder.layers.1.self_attention.linear_qkv.lora_A.weight");

  // First 2, last 1: the middle stage gets the remaining 1 layer.
  lora::Plan g = lora::plan(c, options({"linear_qkv"}, 2, {.pp = 3, .first_stage_layers = 2, .last_stage_layers = 1}));
  EXPECT_EQ(g.stages[0].num_layers, 2);
  EXPECT_EQ(g.stages[1].num_layers, 1);
  EXPECT_EQ(g.stages[2].num_layers, 1);
  EXPECT_EQ(g.stages[2].first_layer, 3);
  EXPECT_EQ(g.stages[2].params, 160);
  // Only the first stage given: the other 3 stages split the remaining 3.
  lora::Plan f = lora::plan(c, options({"linear_qkv"}, 2, {.pp = 4, .first_stage_layers = 1}));
  for (const auto& st : f.stages) EXPECT_EQ(st.num_layers, 1);
  // An empty first stage is allowed (towers only).
  lora::Plan e = lora::plan(c, options({"linear_qkv"}, 2, {.pp = 2, .first_stage_layers = 0}));
  EXPECT_EQ(e.stages[0].params, 0);
  EXPECT_EQ(e.stages[1].params, 4 * 160);
  EXPECT_EQ(e.ranks.size(), 2u);
}

// ---------------------------------------------------------------- scope, towers

TEST(LoraPlan, ScopeLanguageKeepsTowersFrozenAndSaysSo) {
  lora::ModelConfig c = lora::parse_model_config(tiny_omni(), "test");
  ASSERT_TRUE(c.vision.has_value());
  ASSERT_TRUE(c.audio.has_value());
  EXPECT_EQ(c.audio->conv_out_in, 0);  // no downsample keys: conv_out not modelled

  lora::Plan lang = lora::plan(c, options({"linear_fc1"}, 2));
  for (const auto& n : adapted_names(lang)) EXPECT_EQ(n.rfind("decoder.", 0), 0u) << n;
  EXPECT_EQ(lang.adapted_tower_modules, 0);
  ASSERT_EQ(lang.notes.size(), 1u);
  EXPECT_NE(lang.notes[0].find("2 vision tower modules"), std::string::npos) << lang.notes[0];

  // Scope all: the 2 ViT mlp.linear_fc1 (16 -> 24) join: 2 * 2 * (16 + 24) = 160 more, on stage 0.
  lora::Plan all = lora::plan(c, options({"linear_fc1"}, 2, {.pp = 2}, lora::Scope::kAll));
  lora::Plan lang_pp = lora::plan(c, options({"linear_fc1"}, 2, {.pp = 2}));
  EXPECT_EQ(all.stages[0].params, lang_pp.stages[0].params + 160);
  EXPECT_EQ(all.stages[1].params, lang_pp.stages[1].params);
  EXPECT_EQ(all.adapted_tower_modules, 2);
  EXPECT_EQ(all.stages[0].layout[0].name, "visual.blocks.0.mlp.linear_fc1.lora_A.weight");
  bool said = false;
  for (const auto& n : all.notes) said |= n.find("scope all") != std::string::npos;
  EXPECT_TRUE(said);

  // A tower-only suffix in language scope is an error that says how to get it.
  EXPECT_LEANSTEP_ERROR(lora::plan(c, options({"attn.qkv"}, 2)), "matches only tower modules");

  // all-linear, scope all. Vision per block: qkv 16 -> 48: 128; proj 16 -> 16: 64; fc1: 80; fc2: 80 -> 352.
  // Audio: q, k, v, out 8 -> 8: 4 * 32; fc1 8 -> 16: 48; fc2: 48; proj1 8 -> 8: 32; proj2 8 -> 32: 80.
  lora::Plan everything = lora::plan(c, options({"all-linear"}, 2, {}, lora::Scope::kAll));
  lora::Plan language = lora::plan(c, options({"all-linear"}, 2));
  EXPECT_EQ(everything.total_params - language.total_params, 2 * 352 + (4 * 32 + 48 + 48) + 32 + 80);
  EXPECT_EQ(everything.adapted_tower_modules, 2 * 4 + 6 + 2);
  EXPECT_EQ(everything.stages[0].layout[0].name, "audio_tower.layers.0.self_attn.q_proj.lora_A.weight");
}

// ---------------------------------------------------------------- config errors

TEST(LoraConfig, ErrorsNameTheKey) {
  json c = tiny_llama();
  c["model_type"] = "gpt2";
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(c, "x.json"), "unknown model_type 'gpt2'");
  c.erase("model_type");
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(c, "x.json"), "key 'model_type' is missing");

  json m = tiny_moe();
  m.erase("moe_intermediate_size");
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(m, "x.json"), "key 'moe_intermediate_size' is missing (model_type qwen3_moe)");
  json d = tiny_moe();
  d.erase("intermediate_size");  // needed: layers 0, 2, 3 are dense
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(d, "x.json"), "key 'intermediate_size' is missing");
  json h = tiny_moe();
  h.erase("head_dim");
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(h, "x.json"), "key 'head_dim' is missing");
  json bad = tiny_moe();
  bad["hidden_size"] = "32";
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(bad, "x.json"), "key 'hidden_size' must be an integer");
  bad["hidden_size"] = 0;
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(bad, "x.json"), "key 'hidden_size' must be >= 1");
  json mo = tiny_moe();
  mo["mlp_only_layers"] = {7};
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(mo, "x.json"), "'mlp_only_layers' has layer 7 outside [0, 4)");

  json o = tiny_omni();
  o["thinker_config"]["text_config"].erase("num_attention_heads");
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(o, "x.json"), "key 'thinker_config.text_config.num_attention_heads' is missing");
  json ov = tiny_omni();
  ov["thinker_config"]["vision_config"].erase("depth");
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(ov, "x.json"), "key 'thinker_config.vision_config.depth' is missing");
  json ot = tiny_omni();
  ot.erase("thinker_config");
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(ot, "x.json"), "key 'thinker_config' is missing");

  json q = tiny_qwen3_5();
  q["text_config"].erase("linear_value_head_dim");
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(q, "x.json"), "key 'text_config.linear_value_head_dim' is missing");
  json lt = tiny_qwen3_5();
  lt["text_config"]["layer_types"][1] = "sliding_attention";
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(lt, "x.json"), "entry 1 must be");
  lt["text_config"]["layer_types"] = {"full_attention"};
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(lt, "x.json"), "must have num_hidden_layers = 4 entries");
  json n = tiny_qwen3_next();
  n.erase("full_attention_interval");
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(n, "x.json"), "key 'layer_types' is missing (and so is full_attention_interval)");

  EXPECT_LEANSTEP_ERROR(lora::load_model_config(model_path("does-not-exist.json")), "cannot open");
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(json::array(), "x.json"), "must be a JSON object");
}

TEST(LoraConfig, LlamaDefaultsFollowHuggingFace) {
  json c = tiny_llama();
  c.erase("num_key_value_heads");
  lora::ModelConfig m = lora::parse_model_config(c, "test");
  EXPECT_EQ(m.num_key_value_heads, 4);
  EXPECT_EQ(m.head_dim, 16);
  c["head_dim"] = 8;
  EXPECT_EQ(lora::parse_model_config(c, "test").head_dim, 8);
  json q = tiny_llama();
  q["model_type"] = "qwen3";
  q.erase("num_key_value_heads");
  EXPECT_LEANSTEP_ERROR(lora::parse_model_config(q, "x.json"), "key 'num_key_value_heads' is missing (model_type qwen3)");
}

// ---------------------------------------------------------------- real configs

TEST(LoraReal, ConfigsParseWithTheirArchitecture) {
  lora::ModelConfig q3 = lora::load_model_config(model_path("qwen3-30b-a3b.config.json"));
  EXPECT_EQ(q3.num_layers, 48);
  EXPECT_EQ(q3.num_experts, 128);
  EXPECT_FALSE(q3.vision.has_value());
  lora::ModelConfig omni = lora::load_model_config(model_path("qwen3-omni-30b-a3b-instruct.config.json"));
  EXPECT_EQ(omni.hidden_size, 2048);
  EXPECT_EQ(omni.num_layers, 48);
  EXPECT_EQ(omni.shared_expert_intermediate_size, 0);
  ASSERT_TRUE(omni.vision && omni.audio);
  EXPECT_EQ(omni.vision->depth, 27);
  EXPECT_EQ(omni.audio->layers, 32);
  EXPECT_EQ(omni.audio->conv_out_in, 480 * 16);  // 128 mel bins -> 64 -> 32 -> 16
  lora::ModelConfig q35 = lora::load_model_config(model_path("qwen3.5-35b-a3b.config.json"));
  lora::ModelConfig next = lora::load_model_config(model_path("qwen3-next-80b-a3b-instruct.config.json"));
  for (const auto* c : {&q35, &next}) {
    int full = 0;
    for (int64_t i = 0; i < c->num_layers; ++i) {
      bool is_full = c->layers[static_cast<size_t>(i)].attention == lora::AttentionKind::kFull;
      EXPECT_EQ(is_full, (i + 1) % 4 == 0) << c->model_type << " layer " << i;
      full += is_full;
      EXPECT_EQ(c->layers[static_cast<size_t>(i)].mlp, lora::MlpKind::kMoE);
    }
    EXPECT_EQ(full, c->num_layers / 4);
    EXPECT_TRUE(c->attn_output_gate);
    EXPECT_EQ(c->shared_expert_intermediate_size, 512);
  }
  EXPECT_TRUE(q35.vision.has_value());
  EXPECT_FALSE(q35.audio.has_value());
  EXPECT_EQ(q35.linear_attention, lora::LinearAttentionNaming::kQwen3_5);
  EXPECT_EQ(next.linear_attention, lora::LinearAttentionNaming::kQwen3Next);
}

TEST(LoraReal, Qwen3_30bAllLinearByHand) {
  // r 32 per layer: qkv 32 * (2048 + 5120) = 229376; proj 32 * (4096 + 2048) = 196608;
  // experts fc1 128 * 32 * (2048 + 1536) = 14680064; fc2 128 * 32 * (768 + 2048) = 11534336.
  lora::ModelConfig c = lora::load_model_config(model_path("qwen3-30b-a3b.config.json"));
  lora::Plan p = lora::plan(c, options({"all-linear"}, 32));
  EXPECT_EQ(p.total_params, 48LL * (229376 + 196608 + 14680064 + 11534336));
  EXPECT_EQ(p.stages[0].tensors, 48LL * (2 + 2 + 2 * 128 * 2));
  // The explicit list without linear_proj trains less: the classic silent coverage change.
  lora::Plan q = lora::plan(c, options({"linear_qkv", "linear_fc1", "linear_fc2"}, 32));
  EXPECT_EQ(p.total_params - q.total_params, 48LL * 196608);
}

TEST(LoraReal, ParallelismIsSelfConsistent) {
  struct Setting {
    int64_t tp, pp, ep;
  };
  for (const std::string& file : kRealConfigs) {
    SCOPED_TRACE(file);
    lora::ModelConfig c = lora::load_model_config(model_path(file));
    for (auto scope : {lora::Scope::kLanguage, lora::Scope::kAll}) {
      lora::Plan base = lora::plan(c, options({"all-linear", "all-router"}, 16, {}, scope));
      // One rank, no parallelism: the rank trains the whole (unique) model.
      EXPECT_EQ(base.stages[0].params, base.total_params);
      auto expert_params = [](const lora::StagePlan& st) {
        int64_t s = 0;
        for (const auto& am : st.adapted) s += am.module->grouped_experts ? am.params : 0;
        return s;
      };
      for (Setting s : {Setting{1, 1, 2}, Setting{2, 2, 4}, Setting{1, 4, 8}, Setting{2, 1, 16}}) {
        lora::Plan p = lora::plan(c, options({"all-linear", "all-router"}, 16, {.tp = s.tp, .pp = s.pp, .ep = s.ep}, scope));
        ASSERT_EQ(p.ranks.size(), static_cast<size_t>(s.tp * s.pp * s.ep));
        EXPECT_EQ(p.total_params, base.total_params);
        // The sum over EP ranks of expert parameters is independent of EP, and stages add up.
        int64_t experts = 0;
        for (const auto& st : p.stages) experts += s.ep * expert_params(st);
        EXPECT_EQ(experts, expert_params(base.stages[0]));
        if (s.tp == 1) {
          int64_t all = 0;
          for (const auto& st : p.stages) all += st.params - expert_params(st) + s.ep * expert_params(st);
          EXPECT_EQ(all, base.total_params);
        }
        // EP changes only the expert tensors: the other tensors keep names, shapes, order.
        if (s.pp == 1 && s.tp == 1) {
          auto non_expert = [](const lora::StagePlan& st) {
            std::vector<lora::TensorSpec> out;
            for (const auto& t : st.layout)
              if (t.name.find(".mlp.experts.") == std::string::npos) out.push_back(t);
            return out;
          };
          EXPECT_EQ(non_expert(p.stages[0]), non_expert(base.stages[0]));
          EXPECT_EQ(p.stages[0].tensors - static_cast<int64_t>(non_expert(p.stages[0]).size()),
                    (base.stages[0].tensors - static_cast<int64_t>(non_expert(base.stages[0]).size())) / s.ep);
        }
        // Every tensor's numel sums to the stage params; names are unique on a rank.
        for (const auto& st : p.stages) {
          int64_t n = 0;
          std::set<std::string> names;
          for (const auto& t : st.layout) {
            n += t.numel();
            names.insert(t.name);
          }
          EXPECT_EQ(n, st.params);
          EXPECT_EQ(names.size(), st.layout.size());
          EXPECT_EQ(st.tensors, static_cast<int64_t>(st.layout.size()));
          EXPECT_EQ(st.memory_bytes, 16 * st.params);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- JSON contract

TEST(LoraJson, PlanJsonHasTheContractKeys) {
  lora::ModelConfig c = lora::parse_model_config(tiny_qwen3_5(), "test");
  lora::Plan p = lora::plan(c, options({"linear_qkv", "experts.linear_fc2"}, 2, {.tp = 2, .pp = 2, .ep = 2}));
  json j = json::parse(lora::plan_to_json(p));
  std::set<std::string> keys;
  for (auto& [k, _] : j.items()) keys.insert(k);
  EXPECT_EQ(keys, (std::set<std::string>{"model_type", "parallel", "lora_rank", "targets", "ranks"}));
  EXPECT_EQ(j["model_type"], "qwen3_5_moe");
  EXPECT_EQ(j["parallel"], (json{{"tp", 2}, {"pp", 2}, {"ep", 2}}));
  EXPECT_EQ(j["lora_rank"], 2);
  EXPECT_EQ(j["targets"], (json{"linear_qkv", "experts.linear_fc2"}));
  ASSERT_EQ(j["ranks"].size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    const json& r = j["ranks"][i];
    std::set<std::string> rk;
    for (auto& [k, _] : r.items()) rk.insert(k);
    EXPECT_EQ(rk, (std::set<std::string>{"pp_stage", "tp_rank", "ep_rank", "modules", "tensors", "params",
                                         "memory_bytes", "layout"}));
    EXPECT_EQ(r["pp_stage"], static_cast<int64_t>(i / 4));
    EXPECT_EQ(r["tp_rank"], static_cast<int64_t>(i / 2 % 2));
    EXPECT_EQ(r["ep_rank"], static_cast<int64_t>(i % 2));
  }
  // Stage 1 (layers 2, 3): linear_qkv of layer 3 (64 -> 32 rows under TP 2) and 2 experts' fc2 per layer.
  const json& r1 = j["ranks"][4];
  EXPECT_EQ(r1["modules"], 3);
  EXPECT_EQ(r1["tensors"], 2 + 2 * 2 * 2);
  // qkv: 2 * 32 + 32 * 2 = 128; experts fc2: 2 layers * 2 experts * 2 * (8 + 32) = 320.
  EXPECT_EQ(r1["params"], 128 + 320);
  EXPECT_EQ(r1["memory_bytes"], 16 * (128 + 320));
  EXPECT_EQ(r1["layout"][0], (json{{"name", "decoder.layers.2.mlp.experts.linear_fc2.lora_A.weight0"},
                                  {"shape", {2, 8}},
                                  {"dtype", "bfloat16"}}));
  // The layouts read back are the plan's.
  auto ranks = lora::read_rank_layouts(j, "plan");
  ASSERT_EQ(ranks.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(ranks[i].layout, p.ranks[i].layout());
}

// ---------------------------------------------------------------- diff

namespace {
json dump_of(const lora::Plan& p) { return json::parse(lora::plan_to_json(p)); }
bool mentions(const lora::LayoutDiff& d, const std::string& needle) {
  for (const auto& l : d.differences)
    if (l.find(needle) != std::string::npos) return true;
  return false;
}
}  // namespace

TEST(LoraDiff, IdenticalPlansAndEquivalentTargetLists) {
  lora::ModelConfig c = lora::parse_model_config(tiny_qwen3_5(), "test");
  lora::Plan a = lora::plan(c, options({"all-linear"}, 2, {.tp = 2, .ep = 2}));
  // The explicit list that equals all-linear on this hybrid model.
  lora::Plan b = lora::plan(c, options({"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj_qkv",
                                        "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"},
                                       2, {.tp = 2, .ep = 2}));
  auto d = lora::diff_layouts(lora::read_rank_layouts(dump_of(a), "a"), lora::read_rank_layouts(dump_of(b), "b"));
  EXPECT_TRUE(d.identical()) << (d.differences.empty() ? "" : d.differences[0]);
  EXPECT_EQ(d.ranks_compared, 4);
  // Without the hybrid projections the explicit list silently drops the Gated DeltaNet layers.
  lora::Plan e = lora::plan(c, options({"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}, 2, {.tp = 2, .ep = 2}));
  auto de = lora::diff_layouts(lora::read_rank_layouts(dump_of(a), "a"), lora::read_rank_layouts(dump_of(e), "e"), "a", "e");
  EXPECT_FALSE(de.identical());
  EXPECT_EQ(de.ranks_differing, 4);
  // All 4 ranks differ the same way: printed once, naming the other three.
  EXPECT_EQ(de.differences[0],
            "rank (pp_stage 0, tp_rank 0, ep_rank 0) and 3 more ranks with the same differences: (0, 0, 1) (0, 1, 0) (0, 1, 1):");
  EXPECT_EQ(de.count, 4 * 3 * 5 * 2);  // per rank: 3 linear layers x 5 projections x (A, B) in a only
  EXPECT_TRUE(mentions(de, "decoder.layers.0.self_attention.in_proj_qkv.lora_A.weight [2, 32] bfloat16 is in a only"));
  // 3 linear-attention layers x 4 ranks per tensor name pattern.
  ASSERT_EQ(de.summary.size(), 10u);
  EXPECT_EQ(de.summary[0], "only in a: decoder.layers.*.self_attention.in_proj_a.lora_A.weight x 12");
}

TEST(LoraDiff, FindsRenameShapeDtypeOrderAndMissingRank) {
  lora::ModelConfig c = lora::parse_model_config(tiny_moe(), "test");
  lora::Plan p = lora::plan(c, options({"all-linear"}, 2, {.ep = 2}));
  json a = dump_of(p);
  auto base = lora::read_rank_layouts(a, "a");

  json renamed = a;
  renamed["ranks"][1]["layout"][0]["name"] = "decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight";
  auto d = lora::diff_layouts(base, lora::read_rank_layouts(renamed, "b"));
  EXPECT_EQ(d.count, 1);
  EXPECT_TRUE(mentions(d, "rank (pp_stage 0, tp_rank 0, ep_rank 1):"));
  EXPECT_FALSE(mentions(d, "ep_rank 0"));
  EXPECT_TRUE(mentions(d, "renamed tensor "
                          "decoder.layers.0.self_attention.linear_qkv.lora_A.weight -> "
                          "decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"));

  json reshaped = a;
  reshaped["ranks"][0]["layout"][1]["shape"] = {16, 2};
  d = lora::diff_layouts(base, lora::read_rank_layouts(reshaped, "b"));
  EXPECT_EQ(d.count, 1);
  EXPECT_TRUE(mentions(d, "linear_qkv.lora_B.weight changed shape [48, 2] -> [16, 2]"));

  json retyped = a;
  retyped["ranks"][0]["layout"][2]["dtype"] = "float32";
  d = lora::diff_layouts(base, lora::read_rank_layouts(retyped, "b"));
  EXPECT_EQ(d.count, 1);
  EXPECT_TRUE(mentions(d, "linear_proj.lora_A.weight changed dtype bfloat16 -> float32"));

  json reordered = a;
  std::swap(reordered["ranks"][0]["layout"][0], reordered["ranks"][0]["layout"][1]);
  d = lora::diff_layouts(base, lora::read_rank_layouts(reordered, "b"));
  EXPECT_EQ(d.count, 1);
  EXPECT_TRUE(mentions(d, "registration order differs"));

  json missing = a;
  missing["ranks"].erase(1);
  d = lora::diff_layouts(base, lora::read_rank_layouts(missing, "B.json"), "A.json", "B.json");
  EXPECT_EQ(d.count, 1);
  EXPECT_TRUE(mentions(d, "rank (pp_stage 0, tp_rank 0, ep_rank 1):"));
  EXPECT_TRUE(mentions(d, "missing in B.json (A.json has"));

  json dropped = a;
  dropped["ranks"][0]["layout"].erase(dropped["ranks"][0]["layout"].size() - 1);
  d = lora::diff_layouts(base, lora::read_rank_layouts(dropped, "b"));
  EXPECT_EQ(d.count, 1);
  EXPECT_TRUE(mentions(d, "is in A only"));

  // Capped output still counts everything.
  json many = a;
  for (auto& t : many["ranks"][0]["layout"]) t["dtype"] = "float16";
  d = lora::diff_layouts(base, lora::read_rank_layouts(many, "b"), "A", "B", 5);
  EXPECT_EQ(d.count, static_cast<int64_t>(a["ranks"][0]["layout"].size()));
  EXPECT_EQ(d.differences.size(), 7u);  // head, 5 lines, "... and N more"
  EXPECT_TRUE(mentions(d, "more differences"));
  EXPECT_EQ(d.summary.back(), "changed dtype: decoder.layers.*.self_attention.linear_qkv.lora_B.weight x 4");
  bool experts = false;
  for (const auto& l : d.summary) experts |= l == "changed dtype: decoder.layers.*.mlp.experts.linear_fc1.lora_A.weight* x 2";
  EXPECT_TRUE(experts);
}

TEST(LoraDiff, FrameworkDumpFormat) {
  // A dump: a bare list of ranks, indices optional (0), torch dtype strings.
  json dump = json::array({{{"layout",
                             {{{"name", "decoder.layers.0.self_attention.linear_qkv.lora_A.weight"},
                               {"shape", {8, 64}},
                               {"dtype", "torch.bfloat16"}}}}}});
  auto r = lora::read_rank_layouts(dump, "dump");
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].pp_stage, 0);
  EXPECT_EQ(r[0].layout[0].dtype, leanstep::DType::kBFloat16);
  lora::RankLayout same{0, 0, 0, {{"decoder.layers.0.self_attention.linear_qkv.lora_A.weight", {8, 64},
                                   leanstep::DType::kBFloat16}}};
  EXPECT_TRUE(lora::diff_layouts(r, {same}).identical());

  json bad = dump;
  bad[0]["layout"][0]["dtype"] = "torch.complex64";
  EXPECT_LEANSTEP_ERROR(lora::read_rank_layouts(bad, "dump"), "dtype 'torch.complex64' is not a known dtype");
  json dup = dump;
  dup[0]["layout"].push_back(dup[0]["layout"][0]);
  EXPECT_LEANSTEP_ERROR(lora::read_rank_layouts(dup, "dump"), "repeats tensor name");
  json two = json::array({dump[0], dump[0]});
  EXPECT_LEANSTEP_ERROR(lora::read_rank_layouts(two, "dump"), "repeats rank (pp_stage 0, tp_rank 0, ep_rank 0)");
  EXPECT_LEANSTEP_ERROR(lora::read_rank_layouts(json::object(), "dump"), "key 'ranks' is missing");
  json noshape = dump;
  noshape[0]["layout"][0].erase("shape");
  EXPECT_LEANSTEP_ERROR(lora::read_rank_layouts(noshape, "dump"), "ranks[0].layout[0].shape is missing");
}

TEST(LoraPlan, FormatPlanIsTheReportOfThePlan) {
  lora::ModelConfig c = lora::parse_model_config(tiny_moe(), "test");
  lora::Plan p = lora::plan(c, options({"experts.linear_fc1", "linear_qkv"}, 2, {.tp = 2, .ep = 2}));
  const std::string text = lora::format_plan(p, "tiny.json");
  EXPECT_NE(text.find("parallel: tp 2, pp 1, ep 2, etp 1 -> 4 ranks; 2 local experts per EP rank"), std::string::npos)
      << text;
  EXPECT_NE(text.find("lora rank 2, adapter dtype bfloat16, layer index in names: global"), std::string::npos);
  EXPECT_NE(text.find("stage 0: each of its ranks (tp 0-1 x ep 0-1) trains:"), std::string::npos) << text;
  EXPECT_NE(text.find("mlp.experts.linear_fc1 (x2 local experts)"), std::string::npos) << text;
  // Per-rank totals: 704 params (448 qkv + 256 experts, as counted above), 16 bytes each.
  EXPECT_NE(text.find("704"), std::string::npos) << text;
  EXPECT_NE(text.find("model: "), std::string::npos);
  EXPECT_EQ(text.back(), '\n');
}
