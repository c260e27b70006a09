// Realistic gradient layouts for the benchmarks, the demo and the tests.
#pragma once

#include <vector>

#include "leanstep/layout.h"

namespace leanstep::grad::models {

// One rank's trainable tensors of Qwen3-Omni-30B-A3B LoRA fine-tuning: rank-8
// adapters on self_attention.linear_qkv and on the experts' linear_fc1 /
// linear_fc2, expert parallel 8 (16 local experts), TP 1, PP 1, registration
// order, in Megatron naming. Dimensions from the thinker text config of
// qwen3-omni-30b-a3b-instruct (thinker_config.text_config): hidden_size 2048,
// num_hidden_layers 48, num_experts 128, moe_intermediate_size 768,
// num_attention_heads 32, num_key_value_heads 4, head_dim 128.
// Expert params are marked is_expert (they get their own DDP buffer).
std::vector<layout::ParamSpec> qwen3_omni_lora_rank_params(int lora_rank = 8, int expert_parallel = 8);

// A dense GPT-style model of ~101M parameters (vocab 25000, hidden 1024,
// 6 layers, FFN 4096, biases, layernorms, tied output layer), registration
// order (bf16 params, fp32 grads). The benchmark lays it out with the
// distributed optimizer at dp_size 6 (bucket ends padded to lcm(6, 128) = 384).
std::vector<layout::ParamSpec> dense_100m_params();

}  // namespace leanstep::grad::models
