"""Trains a small real Megatron-Core MoE GPT on the CPU under
leanstep.megatron.cpu, as one process or one rank of a gloo world (started by
torch.distributed.run, which sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT).

    python megatron_cpu_worker.py --out DIR [--port P] PHASE [PHASE ...]

A phase is NAME:key=value,... with the keys
  ep       expert-parallel size (default 1)
  distopt  1: the distributed optimizer (default 1)
  finalize 1: leanstep.megatron.cpu.finalize_model_grads_config (default 1);
           0: the forward-backward function never reduces the gradients
  steps    optimizer steps (default 1)
  mbs      micro-batches per step (default 1)
  bf16     1: bf16 parameters, fp32 main params in the optimizer (default 0)
  data     "rank": each rank its own batches; "ranks": every micro-batch i of a
           step is the batch rank i would see (a one-process reference for a
           data-parallel run)
Each phase builds the model anew from the same seed. Rank r writes DIR/rank{r}.pt:
{phase: {"losses": [per step], "params": {name: tensor}, "grad_norms": [...],
"seconds": s}} plus "megatron_core_version".
"""

import argparse
import importlib.util
import os
import sys
import time
import warnings
from functools import partial

warnings.filterwarnings("ignore")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CPU_PY = os.path.join(ROOT, "python", "leanstep", "megatron", "cpu.py")

HIDDEN, LAYERS, HEADS, EXPERTS, TOPK, VOCAB, SEQ, MICRO_BATCH = 64, 2, 4, 4, 2, 128, 32, 2
SEED = 1234


def load_cpu_module():
    """leanstep.megatron.cpu from this checkout's source, without importing the
    leanstep package (its compiled extension may be for another Python)."""
    spec = importlib.util.spec_from_file_location("_leanstep_megatron_cpu", CPU_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_phase(text):
    name, _, rest = text.partition(":")
    opts = dict(ep=1, distopt=1, finalize=1, steps=1, mbs=1, bf16=0, data="rank")
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in opts:
            raise SystemExit(f"unknown phase key {key!r}")
        opts[key] = value if isinstance(opts[key], str) else int(value)
    return name, opts


def batches(rank, step, mbs, data):
    """The micro-batches of one step: deterministic per (source rank, step, index)."""
    out = []
    for i in range(mbs):
        source = i if data == "ranks" else rank
        index = step if data == "ranks" else step * mbs + i
        gen = torch.Generator().manual_seed(1000 * source + index + 1)
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
        out.append(dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                        loss_mask=torch.ones(MICRO_BATCH, SEQ),
                        position_ids=torch.arange(SEQ).expand(MICRO_BATCH, SEQ).contiguous()))
    return out


def run_phase(mcpu, opts, rank):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=opts["ep"])
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED, force_reset_rng=True)

    dtype = torch.bfloat16 if opts["bf16"] else torch.float32
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        ffn_hidden_size=2 * HIDDEN, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_ffn_hidden_size=2 * HIDDEN, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        expert_model_parallel_size=opts["ep"], normalization="RMSNorm", add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=dtype, bf16=bool(opts["bf16"]),
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope")
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=bool(opts["distopt"]))
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=1.0,
                                 use_distributed_optimizer=bool(opts["distopt"]),
                                 bf16=bool(opts["bf16"]), params_dtype=dtype)
    optimizer = get_megatron_optimizer(opt_config, [model])
    if opts["finalize"]:
        mcpu.finalize_model_grads_config(config, [model], optimizer)

    def loss_func(loss_mask, output_tensor):
        loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return out, partial(loss_func, b["loss_mask"])

    fwd_bwd = get_forward_backward_func()
    losses, grad_norms = [], []
    start = time.perf_counter()
    for step in range(opts["steps"]):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        micro = batches(rank, step, opts["mbs"], opts["data"])
        out = fwd_bwd(forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
                      num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                      forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        assert ok, "the optimizer step was skipped"
        losses.append(float(sum(o["lm loss"] for o in out) / len(out)))
        grad_norms.append(float(grad_norm))
    seconds = time.perf_counter() - start
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {"losses": losses, "grad_norms": grad_norms, "params": params, "seconds": seconds}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("phases", nargs="+")
    args = ap.parse_args()
    phases = [parse_phase(p) for p in args.phases]

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ:  # one process, not started by torch.distributed.run
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(args.port)
    torch.set_num_threads(1)
    mcpu = load_cpu_module()
    import megatron.core

    result = {"megatron_core_version": megatron.core.__version__}
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with mcpu.megatron_on_cpu():
            for name, opts in phases:
                result[name] = run_phase(mcpu, opts, rank)
                print(f"rank {rank} {name}: losses {result[name]['losses']} "
                      f"({result[name]['seconds']:.2f} s)", file=sys.stderr)
    finally:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    torch.save(result, os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
