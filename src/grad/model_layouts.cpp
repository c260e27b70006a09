#include "grad/model_layouts.h"

#include <fmt/format.h>

namespace leanstep::grad::models {

std::vector<layout::ParamSpec> qwen3_omni_lora_rank_params(int lora_rank, int expert_parallel) {
  // thinker_config.text_config of qwen3-omni-30b-a3b-instruct
  const int64_t hidden_size = 2048, num_hidden_layers = 48, num_experts = 128, moe_intermediate_size = 768,
                num_attention_heads = 32, num_key_value_heads = 4, head_dim = 128;
  const int64_t r = lora_rank;
  const int64_t local_experts = num_experts / expert_parallel;
  const int64_t qkv_out = (num_attention_heads + 2 * num_key_value_heads) * head_dim;
  const int64_t fc1_out = 2 * moe_intermediate_size;  // gate and up projections fused (SwiGLU)
  std::vector<layout::ParamSpec> params;
  for (int64_t layer = 0; layer < num_hidden_layers; ++layer) {
    const std::string prefix = fmt::format("decoder.layers.{}.", layer);
    params.push_back({prefix + "self_attention.linear_qkv.lora_A.weight", {r, hidden_size}, DType::kBFloat16});
    params.push_back({prefix + "self_attention.linear_qkv.lora_B.weight", {qkv_out, r}, DType::kBFloat16});
    struct Linear {
      const char* name;
      int64_t in, out;
    };
    for (const Linear& lin : {Linear{"linear_fc1", hidden_size, fc1_out}, Linear{"linear_fc2", moe_intermediate_size, hidden_size}}) {
      for (int64_t e = 0; e < local_experts; ++e)
        params.push_back({fmt::format("{}mlp.experts.{}.lora_A.weight{}", prefix, lin.name, e), {r, lin.in},
                          DType::kBFloat16, /*is_expert=*/true});
      for (int64_t e = 0; e < local_experts; ++e)
        params.push_back({fmt::format("{}mlp.experts.{}.lora_B.weight{}", prefix, lin.name, e), {lin.out, r},
                          DType::kBFloat16, /*is_expert=*/true});
    }
  }
  return params;
}

std::vector<layout::ParamSpec> dense_100m_params() {
  const int64_t vocab = 25000, hidden = 1024, layers = 6, ffn = 4096;
  std::vector<layout::ParamSpec> params;
  params.push_back({"embedding.word_embeddings.weight", {vocab, hidden}});
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = fmt::format("decoder.layers.{}.", l);
    params.push_back({p + "self_attention.linear_qkv.layer_norm_weight", {hidden}});
    params.push_back({p + "self_attention.linear_qkv.weight", {3 * hidden, hidden}});
    params.push_back({p + "self_attention.linear_qkv.bias", {3 * hidden}});
    params.push_back({p + "self_attention.linear_proj.weight", {hidden, hidden}});
    params.push_back({p + "self_attention.linear_proj.bias", {hidden}});
    params.push_back({p + "mlp.linear_fc1.layer_norm_weight", {hidden}});
    params.push_back({p + "mlp.linear_fc1.weight", {ffn, hidden}});
    params.push_back({p + "mlp.linear_fc1.bias", {ffn}});
    params.push_back({p + "mlp.linear_fc2.weight", {hidden, ffn}});
    params.push_back({p + "mlp.linear_fc2.bias", {hidden}});
  }
  params.push_back({"decoder.final_layernorm.weight", {hidden}});
  // output layer tied to the embedding (no separate param)
  return params;
}

}  // namespace leanstep::grad::models
