"""Tiny random Hugging Face models for the leanstep.transformers tests: the
architectures of the four checkpoints in fixtures/hf (their config.json, real
fields kept: eps, rope, norms, expert routing, hybrid layer pattern) scaled
down, plus llama, qwen2, qwen3, mistral and gemma3 from their config classes.
Nothing is downloaded."""

import json
import pathlib

import torch

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"

# The scaled-down widths every model gets (fields a config lacks are ignored).
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=8, num_experts_per_tok=2, vocab_size=128, max_position_embeddings=256,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16)

ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe", "qwen3_next",
                 "qwen3_omni_moe", "qwen3_5_moe"]

_CHECKPOINTS = {"qwen3_moe": ("qwen3-30b-a3b.config.json", None),
                "qwen3_next": ("qwen3-next-80b-a3b-instruct.config.json", None),
                "qwen3_omni_moe": ("qwen3-omni-30b-a3b-instruct.config.json",
                                   ("thinker_config", "text_config")),
                "qwen3_5_moe": ("qwen3.5-35b-a3b.config.json", ("text_config",))}


def _checkpoint_fields(arch, layers):
    name, path = _CHECKPOINTS[arch]
    fields = json.loads((FIXTURES / name).read_text())
    for key in path or ():
        fields = fields[key]
    fields = {k: v for k, v in fields.items() if k not in ("architectures", "model_type")}
    fields.update(TINY, num_hidden_layers=layers)
    if "layer_types" in fields:  # the real pattern, cut to the tiny depth
        fields["layer_types"] = fields["layer_types"][:layers]
    fields.pop("mtp_num_hidden_layers", None)
    return fields


def tiny_model(arch, *, layers=4, dtype=torch.float32, seed=0):
    """(model, returns_logits): a random tiny model of ``arch`` whose norm
    weights are random too (a test of the weight's convention, not ones or
    zeros), in eval mode (no dropout)."""
    import transformers as tf

    torch.manual_seed(seed)
    small = dict(TINY, num_hidden_layers=layers)
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**small))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**small))
    elif arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**small))
    elif arch == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**small))
    elif arch == "gemma3":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**small, sliding_window=8))
    elif arch == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**_checkpoint_fields(arch, layers)))
    elif arch == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**_checkpoint_fields(arch, layers)))
    elif arch == "qwen3_omni_moe":
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as omni
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import \
            Qwen3OmniMoeTextConfig
        model = omni.Qwen3OmniMoeThinkerTextModel(
            Qwen3OmniMoeTextConfig(**_checkpoint_fields(arch, layers)))
    elif arch == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import \
            Qwen3_5MoeTextConfig
        model = tf.Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**_checkpoint_fields(arch, layers)))
    else:
        raise ValueError(f"unknown architecture {arch!r}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(0.0, 0.5) if (p == 0).all() else p.normal_(1.0, 0.5)
    return model.to(dtype).eval(), hasattr(model, "lm_head")


def lora(model, seed=0):
    """PEFT LoRA (r 4) on the attention and MLP projections that exist, with
    random B (PEFT's zero init would make every LoRA grad but B's zero)."""
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    targets = sorted(names & {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj", "in_proj_qkvz", "out_proj"})
    wrapped = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return wrapped


def word_tokenizer(words, specials=(), pad_token="t0", eos_token="t1"):
    """A word-level tokenizer built here (no download): "t0" .. "t<words-1>"
    as ids 0 .. words-1, then ``specials``, split on whitespace."""
    import transformers as tf
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {f"t{i}": i for i in range(words)}
    vocab.update({special: words + i for i, special in enumerate(specials)})
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=pad_token,
                                      eos_token=eos_token)
