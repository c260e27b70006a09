"""Device backends: the same operations as the C++ kernels, for tensors on any torch device.

:data:`IMPLEMENTATIONS` names, per backend, the ops it implements and how:
``leanstep.paths()`` lists them beside the C++ registry's CPU implementations.
"""

IMPLEMENTATIONS = {
    "torch": {
        "grad.norm": "_foreach_norm per region (float64 accumulation) + one reduction",
        "grad.unscale_norm": "_amp_foreach_non_finite_check_and_unscale_, then the norm",
        "grad.unscale": "_amp_foreach_non_finite_check_and_unscale_ (one pass)",
        "grad.clip": "coefficient on the device (one fp32 division, clamp), _foreach_mul_",
        "grad.norm_clip": "norm, then clip",
        "grad.scale": "_foreach_mul_ with a 0-dim fp32 scalar",
        "grad.count_zeros": "count_nonzero per region, int64 sum",
        "grad.multi_tensor_scale": "fp32 _foreach_mul, _foreach_copy_ (pairs sharing memory in order)",
        "rmsnorm.forward": "aten._fused_rms_norm where the build has a kernel, else composite",
        "rmsnorm.backward": "aten._fused_rms_norm_backward with output_mask [True, False], "
                            "or the composite dx",
        "moe.permute": "cumsum index arithmetic (fused) or stable FP32-key sort (sort)",
        "moe.unpermute": "fp32 index_add_ in slot order, one cast",
        "moe.permute_backward": "fp32 index_add_ in slot order",
        "moe.permute_probs_backward": "scatter of the probs gradient",
        "moe.unpermute_backward": "gather and per-slot dot products",
        "moe.pad_routing_map": "per-expert ranks from cumsums",
        "moe.sort_chunks_by_idxs": "source rows by index arithmetic on the split sizes",
    },
    "triton": {
        "grad.norm": "one pass over the chunk table (partials in fixed slots) + a fixed-order "
                     "finish: 2 launches",
        "grad.unscale_norm": "unscale, found_inf and norm in the same single pass: 2 launches",
        "grad.unscale": "one pass, found_inf stored directly: 1 launch",
        "grad.clip": "coefficient from the device norm in every program, scale in place: "
                     "1 launch",
        "grad.norm_clip": "norm, then clip: 3 launches",
        "grad.scale": "1 launch over the chunk table",
        "grad.count_zeros": "per-chunk counts + a fixed-order finish: 2 launches",
        "grad.multi_tensor_scale": "fp32 math, one cast, every dtype pair in 1 launch",
        "rmsnorm.forward": "one launch, persistent over rows, fp32 rstd",
        "rmsnorm.backward": "frozen: dx only, 1 launch; trainable: dx + per-chunk dgamma "
                            "partials, then a fixed-order sum: 2 launches",
        "moe.permute": "per-expert rank scan, scatter of the slots, row gather: 3 launches",
        "moe.unpermute": "stable slot order per token (torch sort), fp32 sums in slot order: "
                         "1 Triton launch",
        "moe.permute_backward": "the unpermute kernel without probs",
    },
}
