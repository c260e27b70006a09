"""LoRA adapters on Megatron-Core modules, with the LoRA planner's names.

    from leanstep.megatron.lora import apply_lora, lora_state_dict

    report = apply_lora(model, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                        rank=8, alpha=16)
    print(report.format())           # adapted modules, tensors, parameters
    ...                              # then Float16Module / DDP / the optimizer, as usual
    torch.save(lora_state_dict(model), "adapters.pt")

Call :func:`apply_lora` on the bare model (a ``GPTModel``, or a ``Float16Module``
around one) BEFORE wrapping it in Megatron's ``DistributedDataParallel`` and
building the optimizer: DDP lays out its gradient buffers from the parameters
that require a gradient when it is constructed.

What an adapter is
------------------
An adapted module keeps its class's behaviour, its own parameters (frozen:
``requires_grad=False``) and their names; it gains two bias-free linears
``lora_A`` (weight ``[r, in]``) and ``lora_B`` (weight ``[out, r]``), so the
trainable tensors are ``<module>.lora_A.weight`` and ``<module>.lora_B.weight``
(the planner's names, without peft's adapter-name level). Its forward returns
the base module's ``(output, bias)`` tuple with

    output = base_output + dropout(x) @ A^T @ B^T * (alpha / r)

``A`` starts Kaiming-uniform (``a = sqrt(5)``, as ``torch.nn.Linear`` and peft's
default) or normal with std ``1 / r`` (``init="gaussian"``), ``B`` starts at zero,
so the model's output at initialisation is exactly the base model's. There is
no merge: the base weights are never modified. Adapters get the dtype and
device of the base weight unless `dtype` says otherwise.

The module's class is replaced by a subclass that adds the adapter path
(``LoraColumnParallelLinear`` for ``ColumnParallelLinear``, ...), so
``isinstance`` checks, the parameter names of the base module and its
``state_dict`` keys stay as they were.

Modules that take adapters
--------------------------
- ``megatron.core.tensor_parallel.ColumnParallelLinear`` / ``RowParallelLinear``:
  attention (``linear_qkv``, ``linear_proj``), dense MLPs, shared experts, and the
  routed experts of ``SequentialMLP`` (the local spec with
  ``moe_grouped_gemm=False``: one ``MLP`` per local expert,
  ``mlp.experts.local_experts.<j>.linear_fc1``). ``output_layer`` never takes an
  adapter (the planner does not model it; its weight may be the shared embedding).
- ``torch.nn.Linear`` modules (the HF modules some Megatron models keep, e.g.
  the Gated DeltaNet projections ``in_proj_qkv`` ... ``out_proj`` the planner
  lists): not tensor-parallel, so the adapters are replicated; the forward
  returns the base tensor plus the adapter's contribution.
- MoE routers (``Router`` subclasses, e.g. ``TopKRouter``, weight
  ``[experts, hidden]``): the adapter is added to the gating logits, in the
  logits' dtype. Only by ``"all-router"`` or an explicit suffix (``router``).
- Transformer Engine linears (``TELinear``, ``TEColumnParallelLinear``,
  ``TERowParallelLinear``; ``TELayerNormColumnParallelLinear``, whose adapter
  reads the input normalised by the module's own norm weights, recomputed in
  torch) when ``transformer_engine`` imports. UNTESTED HERE: no Transformer
  Engine is installed where this module's tests run.
- Refused, naming the module: fused expert weights (``GroupedMLP``,
  ``TEGroupedMLP`` and the TE grouped linears, any other ``experts`` module that
  is not a ``SequentialMLP``), and tensor-parallel splits (TP > 1 or expert TP > 1
  on a module that would be adapted): only TP 1 is implemented.

Expert-parallel gradient buffers
--------------------------------
Megatron marks a parameter for the expert gradient buffers (expert-data-parallel
reduction, the expert optimizer) with ``param.allreduce = False``. Its own rule
(``tensor_parallel.layers`` and the TE wrappers): in 0.16,
``allreduce = not (is_expert and expert_model_parallel_size > 1)``; in 0.19,
``allreduce = not (is_expert and (expert_model_parallel_size > 1 or
expert_tensor_parallel_size != tensor_model_parallel_size))``. So at EP 1 (and
ETP = TP) Megatron keeps expert weights in the dense buffers, and with EP > 1
in the expert buffers. The adapters of a module copy its weight's mark (and
its ``sequence_parallel`` mark, which routers carry), so they always sit in the
same buffer as the weight they adapt, whatever the installed version's rule;
dense adapters are ``allreduce=True``, router adapters leave it unset (as the
router weight does). Column-parallel ``lora_B`` and row-parallel ``lora_A`` get
Megatron's tensor-parallel attributes (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``), as their base weights do.

Targets (the planner's rules, ``docs/lora.md``)
-----------------------------------------------
``targets`` is a list (or a comma-separated string) of module-name SUFFIXES,
matched at ``.`` boundaries, and the keywords ``"all-linear"`` (every
adaptable linear of the language model, experts included, routers and
``output_layer`` excluded) and ``"all-router"`` (every router). Suffixes are
matched against the planner's form of each module's name (global layer index,
routed experts as one grouped module ``mlp.experts.linear_fc1``) and against the
Megatron name with the global layer index (``mlp.experts.local_experts.2.linear_fc1``
names one expert). So ``linear_fc1`` matches dense, routed and shared-expert fc1,
``experts.linear_fc1`` only the routed experts. A target that matches nothing
is an error. ``scope="language"`` (default) never adapts modules of a vision or
audio tower (a name component in :data:`TOWER_COMPONENTS`); the report notes
what a target would have matched there. ``scope="all"`` adapts them too.

Names: Megatron's and the planner's
-----------------------------------
The planner models routed experts as Megatron's grouped linears name them
(``decoder.layers.0.mlp.experts.linear_fc1.lora_A.weight3``); ``SequentialMLP``
registers one module per local expert
(``decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.lora_A.weight``).
:func:`to_planner_name` / :func:`from_planner_name` map one to the other
(expert indices LOCAL to the EP rank in both; layer indices are left as they
are), :meth:`LoraReport.layout` and :meth:`LoraReport.dump` give the trainable
tensors under either naming (the dump is ``leanstep lora diff``'s format). Names
and shapes then agree with the plan exactly; two ORDERS differ by construction:
Megatron's attention registers ``linear_proj`` before ``linear_qkv`` (the base
class builds the output projection first), and ``SequentialMLP`` registers per
expert (fc1 A, fc1 B, fc2 A, fc2 B, then the next expert), the planner per grouped
module (all fc1 A, all fc1 B, then fc2). The report keeps Megatron's registration
order, which is the order DDP's buffers see.
"""

import dataclasses
import math
import re
import zlib
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "apply_lora",
    "lora_report",
    "mark_only_lora_trainable",
    "lora_state_dict",
    "load_lora_state_dict",
    "lora_parameters",
    "is_lora_parameter_name",
    "is_lora_module",
    "to_planner_name",
    "from_planner_name",
    "LoraReport",
    "AdaptedModule",
    "LoraTensor",
    "LoraFactor",
    "TOWER_COMPONENTS",
]

#: Name components that put a module in a vision or audio tower (out of
#: ``scope="language"``): the towers' names in Megatron's multimodal models
#: (``vision_model``, ``vision_projection``) and in the HF-based ones the planner
#: models (``visual``, ``audio_tower``).
TOWER_COMPONENTS = frozenset({"visual", "vision_model", "vision_tower", "vision_projection",
                              "audio_tower", "audio_model", "audio_projection"})

_KEYWORDS = ("all-linear", "all-router")
_INITS = ("kaiming", "gaussian")
_LORA_PARAM = re.compile(r"(^|\.)lora_[AB]\.weight$")
_LOCAL_EXPERT = re.compile(r"(^|\.)experts\.local_experts\.(\d+)\.")
_GROUPED_LORA = re.compile(r"(^|\.)experts\.(.+)\.lora_([AB])\.weight(\d+)$")


# ---------------------------------------------------------------- names


def to_planner_name(name):
    """A Megatron parameter or module name in the planner's form: a
    ``SequentialMLP`` expert's ``...mlp.experts.local_experts.<j>.<rest>`` becomes
    ``...mlp.experts.<rest>`` and, for an adapter tensor, ``lora_A.weight`` /
    ``lora_B.weight`` becomes ``lora_A.weight<j>`` / ``lora_B.weight<j>`` (the
    grouped linears' numbering; ``j`` is the LOCAL expert index in both). Other
    names are returned unchanged."""
    m = _LOCAL_EXPERT.search(name)
    if m is None:
        return name
    j = m.group(2)
    out = name[:m.start()] + m.group(1) + "experts." + name[m.end():]
    if _LORA_PARAM.search(out):
        out += j
    return out


def from_planner_name(name):
    """The inverse of :func:`to_planner_name` for adapter tensors: a grouped
    expert tensor ``...mlp.experts.<rest>.lora_A.weight<j>`` becomes
    ``...mlp.experts.local_experts.<j>.<rest>.lora_A.weight``. Other names are
    returned unchanged (a grouped module name without ``weight<j>`` names all
    experts and has no single Megatron counterpart)."""
    m = _GROUPED_LORA.search(name)
    if m is None:
        return name
    return (name[:m.start()] + m.group(1) + f"experts.local_experts.{m.group(4)}.{m.group(2)}"
            f".lora_{m.group(3)}.weight")


def is_lora_parameter_name(name):
    """True for ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``."""
    return bool(_LORA_PARAM.search(name))


def _strip_wrappers(name):
    # Float16Module / DDP-style wrappers hold the model as `.module`.
    while name.startswith("module."):
        name = name[len("module."):]
    return "" if name == "module" else name


def _suffix_matches(name, suffix):
    if not suffix or len(suffix) > len(name) or not name.endswith(suffix):
        return False
    return len(suffix) == len(name) or name[len(name) - len(suffix) - 1] == "."


def _in_tower(name):
    return any(part in TOWER_COMPONENTS for part in name.split("."))


# ---------------------------------------------------------------- the adapter


class LoraFactor(torch.nn.Module):
    """One factor of an adapter: a bias-free linear, weight ``[out, in]``."""

    def __init__(self, weight):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = torch.nn.Parameter(weight)

    def forward(self, x):
        return F.linear(x, self.weight)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


def _lora_delta(module, x, out_dtype):
    a = module.lora_A.weight
    h = x if x.dtype == a.dtype else x.to(a.dtype)
    if module.lora_dropout > 0.0 and module.training:
        h = F.dropout(h, p=module.lora_dropout, training=True)
    delta = F.linear(F.linear(h, a), module.lora_B.weight) * module.lora_scaling
    return delta if delta.dtype == out_dtype else delta.to(out_dtype)


# The adapter paths. Each is a method of a one-base subclass of the module's
# class, `base` (a subclass with a mixin as a second base cannot be assigned to
# __class__ of some Megatron modules, e.g. routers, whose bases include ABC).


def _linear_forward(base):
    def forward(self, input_, *args, **kwargs):
        """The base module's ``(output, bias)``, the adapter's contribution
        added to ``output``."""
        result = base.forward(self, input_, *args, **kwargs)
        if not isinstance(result, tuple):  # torch.nn.Linear; Megatron's return (out, bias)
            return result + _lora_delta(self, input_, result.dtype)
        output, *rest = result
        return (output + _lora_delta(self, input_, output.dtype), *rest)

    return {"forward": forward}


def _te_layernorm_normed_input(module, x):
    # TELayerNormColumnParallelLinear normalises inside its GEMM; the adapter
    # reads the same normalised input, recomputed in torch (untested here).
    weight = module.layer_norm_weight
    if getattr(module, "zero_centered_gamma", False):
        weight = weight + 1
    eps = getattr(module, "eps", 1e-5)
    if getattr(module, "normalization", "LayerNorm") == "RMSNorm":
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return y * weight.to(x.dtype)
    bias = getattr(module, "layer_norm_bias", None)
    return F.layer_norm(x, (x.shape[-1],), weight.to(x.dtype),
                        None if bias is None else bias.to(x.dtype), eps)


def _te_layernorm_linear_forward(base):
    def forward(self, x, *args, **kwargs):
        """The base module's ``(output, bias)``, the adapter (on the normalised
        input) added to ``output``."""
        output, *rest = base.forward(self, x, *args, **kwargs)
        return (output + _lora_delta(self, _te_layernorm_normed_input(self, x), output.dtype), *rest)

    return {"forward": forward}


def _router_gating(base):
    def gating(self, input, *args, **kwargs):
        """The base router's gating logits plus the adapter's contribution."""
        logits = base.gating(self, input, *args, **kwargs)
        return logits + _lora_delta(self, input, logits.dtype)

    return {"gating": gating}


_PATHS = {"router": _router_gating, "te_layernorm_linear": _te_layernorm_linear_forward}
_CLASSES = {}


def _lora_class(base_cls, kind):
    path = _PATHS.get(kind, _linear_forward)
    key = (base_cls, path)
    cls = _CLASSES.get(key)
    if cls is None:
        name = "Lora" + base_cls.__name__
        while name in globals():  # another base class of the same name
            name += "_"
        cls = type(name, (base_cls,), {"__module__": __name__, "__qualname__": name,
                                       "_lora_base_class": base_cls, **path(base_cls)})
        _CLASSES[key] = cls
        globals()[name] = cls  # importable by name, so adapted modules pickle
    return cls


def is_lora_module(module):
    """True for a module that :func:`apply_lora` adapted."""
    return hasattr(type(module), "_lora_base_class") and hasattr(module, "lora_A")


# ---------------------------------------------------------------- module discovery


@dataclasses.dataclass(frozen=True)
class _Candidate:
    name: str            # Megatron module name, wrappers stripped, layer index as registered
    planner_name: str    # planner form (global layer index, grouped experts)
    global_name: str     # Megatron form with the global layer index
    module: Optional[torch.nn.Module]
    kind: str            # column, row, linear, router, te_linear, te_layernorm_linear, unsupported
    in_features: int = 0
    out_features: int = 0
    is_expert: bool = False
    is_router: bool = False
    reason: str = ""     # kind "unsupported": why


def _megatron_classes():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.router import Router

    sequential = grouped = ()
    try:
        from megatron.core.transformer.moe import experts as experts_mod

        sequential = (experts_mod.SequentialMLP,)
        grouped = tuple(getattr(experts_mod, n) for n in ("GroupedMLP", "TEGroupedMLP")
                        if hasattr(experts_mod, n))
    except ImportError:  # pragma: no cover - every supported version has it
        pass
    return ColumnParallelLinear, RowParallelLinear, Router, sequential, grouped


def _te_classes():
    """(linear classes, layernorm-linear classes, grouped-linear classes) of
    Megatron's Transformer Engine wrappers; empty when TE does not import."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions import transformer_engine as te_ext
    except Exception:  # noqa: BLE001 - no (usable) Transformer Engine: no TE modules exist
        return (), (), ()
    if not getattr(te_ext, "HAVE_TE", True):  # Megatron found no usable TE
        return (), (), ()
    linear = tuple(getattr(te_ext, n) for n in ("TELinear",) if hasattr(te_ext, n))
    norm = tuple(getattr(te_ext, n) for n in ("TELayerNormColumnParallelLinear",)
                 if hasattr(te_ext, n))
    grouped = tuple(getattr(te_ext, n) for n in ("TEGroupedLinear",) if hasattr(te_ext, n))
    return linear, norm, grouped


def _layer_renames(named):
    """{'...decoder.layers.<k>': '...decoder.layers.<global>'} from each
    TransformerLayer's ``layer_number`` (1-based, global under pipeline
    parallelism); empty where they are equal."""
    out = {}
    for name, mod in named.items():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit():
            number = getattr(mod, "layer_number", None)
            if isinstance(number, int) and number - 1 != int(parts[-1]):
                out[name] = ".".join(parts[:-1] + [str(number - 1)])
    return out


def _globalise(name, renames):
    if not renames:
        return name
    # the longest registered layer prefix of `name`
    best = None
    for prefix in renames:
        if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return name if best is None else renames[best] + name[len(best):]


def _linear_dims(mod, kind):
    """(in, out) of the base weight, unsplit."""
    if kind in ("column", "row"):
        return int(mod.input_size), int(mod.output_size)
    return int(mod.weight.shape[1]), int(mod.weight.shape[0])


def _tp_problem(mod, kind):
    """Why this module's tensor-parallel layout is not supported (None if it is)."""
    if kind == "column":
        if mod.output_size_per_partition != mod.output_size:
            return (f"its weight is split over tensor-parallel ranks (output {mod.output_size} -> "
                    f"{mod.output_size_per_partition} per rank)")
    elif kind == "row":
        if mod.input_size_per_partition != mod.input_size:
            return (f"its weight is split over tensor-parallel ranks (input {mod.input_size} -> "
                    f"{mod.input_size_per_partition} per rank)")
    elif kind in ("te_linear", "te_layernorm_linear"):
        tp = int(getattr(mod, "tp_size", 1) or 1)
        if tp > 1 and getattr(mod, "parallel_mode", None) in ("column", "row"):
            return f"its weight is split over {tp} tensor-parallel ranks"
    return None


def _candidates(model):
    column, row, router, sequential, grouped = _megatron_classes()
    te_linear, te_norm, te_grouped = _te_classes()
    named = {}
    for raw, mod in model.named_modules():
        name = _strip_wrappers(raw)
        if name and name not in named:
            named[name] = mod
    renames = _layer_renames(named)
    out = []
    claimed = set()  # modules inside an unsupported expert layout
    for name, mod in named.items():
        if any(name.startswith(c + ".") for c in claimed):
            continue
        parts = name.split(".")
        global_name = _globalise(name, renames)
        is_experts_container = (parts[-1] == "experts" and len(parts) >= 2
                                and parts[-2] == "mlp" and not isinstance(mod, sequential))
        if (grouped and isinstance(mod, grouped)) or (te_grouped and isinstance(mod, te_grouped)) \
                or is_experts_container:
            claimed.add(name)
            planner = to_planner_name(global_name)
            what = (f"{type(mod).__name__} holds the experts' weights fused"
                    if isinstance(mod, grouped + te_grouped) else
                    f"{type(mod).__name__} is not an expert layout this module knows")
            for fc in ("linear_fc1", "linear_fc2"):
                out.append(_Candidate(name, f"{planner}.{fc}", f"{global_name}.{fc}", mod,
                                      "unsupported", is_expert=True,
                                      reason=f"{what}; build the model with "
                                             f"get_gpt_layer_local_spec(num_experts=..., "
                                             f"moe_grouped_gemm=False) (SequentialMLP)"))
            continue
        if parts[-1] == "output_layer":
            continue
        kind = None
        if isinstance(mod, router):
            kind = "router"
        elif te_norm and isinstance(mod, te_norm):
            kind = "te_layernorm_linear"
        elif te_linear and isinstance(mod, te_linear):
            kind = "te_linear"
        elif isinstance(mod, column):
            kind = "column"
        elif isinstance(mod, row):
            kind = "row"
        elif isinstance(mod, torch.nn.Linear):
            kind = "linear"
        if kind is None:
            continue
        weight = getattr(mod, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            out.append(_Candidate(name, to_planner_name(global_name), global_name, mod,
                                  "unsupported", reason="it holds no 2-D weight of its own"))
            continue
        in_f, out_f = _linear_dims(mod, kind)
        is_expert = bool(getattr(mod, "is_expert", False)) or ".mlp.experts." in f".{name}."
        out.append(_Candidate(name, to_planner_name(global_name), global_name, mod, kind, in_f,
                              out_f, is_expert and kind != "router", kind == "router"))
    return out


# ---------------------------------------------------------------- report


@dataclasses.dataclass(frozen=True)
class AdaptedModule:
    """One adapted module: its Megatron name (as ``named_modules`` prints it),
    its planner-form name, kind (column, row, linear, router, te_linear,
    te_layernorm_linear), the base weight's full dimensions, rank and alpha."""
    name: str
    planner_name: str
    kind: str
    in_features: int
    out_features: int
    rank: int
    alpha: float
    is_expert: bool


@dataclasses.dataclass(frozen=True)
class LoraTensor:
    """One trainable adapter tensor, in registration order."""
    name: str
    planner_name: str
    shape: tuple
    dtype: torch.dtype
    is_expert: bool
    allreduce: Optional[bool]   # the ``allreduce`` mark (None: not set)

    @property
    def numel(self):
        return math.prod(self.shape)


@dataclasses.dataclass
class LoraReport:
    """The adapters of a model (:func:`apply_lora`'s result, or
    :func:`lora_report`).

    ``targets``: those of the call; ``modules``: every adapted module of the
    model, ``tensors``: its adapter tensors, both in registration order;
    ``num_modules`` counts torch modules (one per local expert),
    ``planner_modules`` counts them as the planner does (a layer's routed
    experts once per fc); ``num_tensors``, ``num_params``, ``expert_params``;
    ``notes``: what a target would have matched in a tower under
    ``scope="language"``."""
    targets: list
    modules: list
    tensors: list
    notes: list

    @property
    def num_modules(self):
        return len(self.modules)

    @property
    def planner_modules(self):
        return len({m.planner_name for m in self.modules})

    @property
    def num_tensors(self):
        return len(self.tensors)

    @property
    def num_params(self):
        return sum(t.numel for t in self.tensors)

    @property
    def expert_params(self):
        return sum(t.numel for t in self.tensors if t.is_expert)

    def layout(self, naming="megatron"):
        """``[{name, shape, dtype}]`` of the trainable tensors, in registration
        order; `naming` "megatron" (``named_parameters()`` names) or "planner"."""
        if naming not in ("megatron", "planner"):
            raise ValueError(f"LoraReport.layout: naming must be 'megatron' or 'planner' "
                             f"(got {naming!r})")
        return [{"name": t.name if naming == "megatron" else t.planner_name,
                 "shape": list(t.shape), "dtype": str(t.dtype)} for t in self.tensors]

    def dump(self, naming="planner", *, pp_stage=0, tp_rank=0, ep_rank=0):
        """This rank's layout in ``leanstep lora diff``'s dump format."""
        return {"ranks": [{"pp_stage": pp_stage, "tp_rank": tp_rank, "ep_rank": ep_rank,
                           "layout": self.layout(naming)}]}

    def format(self):
        """A readable summary, one line per adapted module."""
        lines = [f"LoRA{' (targets ' + ', '.join(self.targets) + ')' if self.targets else ''}: "
                 f"{self.num_modules} modules ({self.planner_modules} as the planner counts them), "
                 f"{self.num_tensors} tensors, {self.num_params:,} parameters "
                 f"({self.expert_params:,} in experts)"]
        for m in self.modules:
            lines.append(f"  {m.name} [{m.kind}{', expert' if m.is_expert else ''}] "
                         f"r={m.rank} alpha={m.alpha:g} A [{m.rank}, {m.in_features}] "
                         f"B [{m.out_features}, {m.rank}]")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------- apply


def _parse_targets(targets):
    if isinstance(targets, str):
        targets = [targets]
    out = []
    for t in targets:
        if not isinstance(t, str):
            raise TypeError(f"apply_lora: targets must be strings (got {t!r})")
        out += [s.strip() for s in t.split(",") if s.strip()]
    if not out:
        raise ValueError("apply_lora: targets is empty (give suffixes, 'all-linear' or 'all-router')")
    return out


def _matches(target, c):
    if target == "all-linear":
        return not c.is_router
    if target == "all-router":
        return c.is_router
    return _suffix_matches(c.planner_name, target) or _suffix_matches(c.global_name, target)


def _init_A(shape, init, rank, generator):
    a = torch.empty(shape, dtype=torch.float32)
    if init == "kaiming":
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    else:
        torch.nn.init.normal_(a, mean=0.0, std=1.0 / rank, generator=generator)
    return a


def _seed_key(c, model_modules):
    """The module's global name with a SequentialMLP local expert index made
    global (from the MoE layer's ``local_expert_indices``), for seeding."""
    m = _LOCAL_EXPERT.search(c.name)
    if m is None:
        return c.global_name
    indices = getattr(model_modules.get(c.name[:m.start()]), "local_expert_indices", None)
    j = int(m.group(2))
    if not isinstance(indices, (list, tuple)) or j >= len(indices):
        return c.global_name
    return _LOCAL_EXPERT.sub(lambda g: f"{g.group(1)}experts.local_experts.{int(indices[j])}.",
                             c.global_name, count=1)


def apply_lora(model, targets=("all-linear",), rank=8, alpha=16, *, dropout=0.0, init="kaiming",
               seed=None, dtype=None, scope="language", freeze=True):
    """Adds LoRA adapters to the modules of `model` that `targets` select
    (see the module docstring) and returns a :class:`LoraReport`.

    `rank` r and `alpha` give the scale alpha / r; `dropout` applies to the
    adapter's input in training mode (0 by default: none). `init` "kaiming"
    (peft's default) or "gaussian" for ``lora_A``; ``lora_B`` is zero. `seed`:
    None draws ``lora_A`` from torch's default CPU generator (identical on all
    data-parallel ranks when they share the seed, as Megatron's set-up does); an
    int seeds each module's own generator from (seed, its global name, with the
    global expert index), independent of call order and EP layout. `dtype`: the
    adapters' dtype (default: the base weight's). `scope` "language" or "all".
    With `freeze` (default), :func:`mark_only_lora_trainable` then freezes
    every parameter but the adapters'.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"apply_lora: rank must be a positive int (got {rank!r})")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 0):
        raise ValueError(f"apply_lora: alpha must be a positive number (got {alpha!r})")
    if not (0.0 <= float(dropout) < 1.0):
        raise ValueError(f"apply_lora: dropout must be in [0, 1) (got {dropout!r})")
    if init not in _INITS:
        raise ValueError(f"apply_lora: init must be one of {_INITS} (got {init!r})")
    if scope not in ("language", "all"):
        raise ValueError(f"apply_lora: scope must be 'language' or 'all' (got {scope!r})")
    try:
        from megatron.core.distributed import DistributedDataParallel as _DDP
    except ImportError:  # pragma: no cover
        _DDP = ()
    if _DDP and isinstance(model, _DDP):
        raise ValueError("apply_lora: the model is already wrapped in Megatron's "
                         "DistributedDataParallel, whose gradient buffers were laid out without "
                         "the adapters; apply LoRA to the bare model, then wrap it")
    targets = _parse_targets(targets)
    cands = _candidates(model)
    in_scope = [c for c in cands if scope == "all" or not _in_tower(c.name)]
    out_of_scope = [c for c in cands if scope == "language" and _in_tower(c.name)]

    chosen, notes = {}, []
    for t in targets:
        hits = [c for c in in_scope if _matches(t, c)]
        tower_hits = [c for c in out_of_scope if _matches(t, c)]
        if tower_hits:
            if hits:
                notes.append(f"scope language: target {t!r} would also match {len(tower_hits)} "
                             f"tower module(s), e.g. {tower_hits[0].name} (scope='all' adapts them)")
            else:
                raise ValueError(f"apply_lora: target {t!r} matches only tower modules "
                                 f"({len(tower_hits)}, e.g. {tower_hits[0].name}), which "
                                 f"scope='language' never adapts; pass scope='all'")
        if not hits:
            if t in _KEYWORDS:
                what = "no router" if t == "all-router" else "no adaptable linear"
                raise ValueError(f"apply_lora: target {t!r} matches nothing: the model has {what}")
            other = [n for n, _ in model.named_modules() if _suffix_matches(_strip_wrappers(n), t)]
            hint = (f" (it names {_strip_wrappers(other[0])}, a "
                    f"{type(dict(model.named_modules())[other[0]]).__name__}, which takes no "
                    f"adapter)" if other else "")
            raise ValueError(f"apply_lora: target {t!r} matches no adaptable module{hint}; "
                             f"targets are module-name suffixes at '.' boundaries, 'all-linear' "
                             f"or 'all-router'")
        for c in hits:
            chosen.setdefault(id(c), c)

    # Refusals first, before any module is changed.
    for c in chosen.values():
        if c.kind == "unsupported":
            raise NotImplementedError(f"apply_lora: cannot adapt {c.name} "
                                      f"({type(c.module).__name__}, target name "
                                      f"{c.planner_name}): {c.reason}")
        if is_lora_module(c.module):
            raise ValueError(f"apply_lora: {c.name} already has a LoRA adapter")
        problem = _tp_problem(c.module, c.kind)
        if problem is not None:
            raise NotImplementedError(f"apply_lora: cannot adapt {c.name} "
                                      f"({type(c.module).__name__}): {problem}; only tensor "
                                      f"parallel size 1 is implemented")

    model_modules = {_strip_wrappers(n): m for n, m in model.named_modules()}
    order = {id(c): i for i, c in enumerate(cands)}
    for c in sorted(chosen.values(), key=lambda c: order[id(c)]):
        _adapt(c, rank, float(alpha), float(dropout), init, seed, dtype, model_modules)
    if freeze:
        mark_only_lora_trainable(model)
    return lora_report(model, targets=targets, notes=notes)


def lora_report(model, *, targets=(), notes=()):
    """A :class:`LoraReport` of every adapter `model` holds (from any number
    of :func:`apply_lora` calls), in registration order."""
    named = {}
    for raw, mod in model.named_modules():
        name = _strip_wrappers(raw)
        if name not in named:
            named[name] = mod
    renames = _layer_renames(named)
    modules, owners = [], {}
    for name, mod in named.items():
        if not is_lora_module(mod):
            continue
        owners[name] = mod
        modules.append(AdaptedModule(name, to_planner_name(_globalise(name, renames)), mod.lora_kind,
                                     mod.lora_A.in_features, mod.lora_B.out_features, mod.lora_rank,
                                     mod.lora_alpha, mod.lora_is_expert))
    tensors = []
    for name, p in lora_parameters(model):
        owner = owners.get(name.rsplit(".", 2)[0])
        is_expert = owner.lora_is_expert if owner is not None else ".mlp.experts." in f".{name}."
        tensors.append(LoraTensor(name, to_planner_name(_globalise(name, renames)), tuple(p.shape),
                                  p.dtype, is_expert, getattr(p, "allreduce", None)))
    return LoraReport(list(targets), modules, tensors, list(notes))


def _adapt(c, rank, alpha, dropout, init, seed, dtype, model_modules):
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    mod = c.module
    weight = mod.weight
    device = weight.device
    adt = dtype if dtype is not None else weight.dtype
    generator = None
    if seed is not None:
        key = _seed_key(c, model_modules)
        generator = torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(key.encode()))
                                                  % 2**63)
    a = _init_A((rank, c.in_features), init, rank, generator).to(device=device, dtype=adt)
    b = torch.zeros((c.out_features, rank), device=device, dtype=adt)
    mod.__class__ = _lora_class(type(mod), c.kind)
    mod.lora_A = LoraFactor(a)
    mod.lora_B = LoraFactor(b)
    mod.lora_rank = rank
    mod.lora_alpha = alpha
    mod.lora_scaling = alpha / rank
    mod.lora_dropout = dropout
    mod.lora_kind = c.kind
    mod.lora_is_expert = c.is_expert
    for p in (mod.lora_A.weight, mod.lora_B.weight):
        for attr in ("allreduce", "sequence_parallel"):
            if hasattr(weight, attr):
                setattr(p, attr, getattr(weight, attr))
    if c.kind in ("column", "te_linear", "te_layernorm_linear") and \
            getattr(mod, "parallel_mode", "column") == "column":
        set_tensor_model_parallel_attributes(mod.lora_B.weight, is_parallel=True, dim=0, stride=1)
    elif c.kind == "row" or (c.kind == "te_linear" and getattr(mod, "parallel_mode", None) == "row"):
        set_tensor_model_parallel_attributes(mod.lora_A.weight, is_parallel=True, dim=1, stride=1)


# ---------------------------------------------------------------- state


def lora_parameters(model):
    """``(name, parameter)`` of every adapter tensor, in registration order."""
    for raw, p in model.named_parameters():
        name = _strip_wrappers(raw)
        if is_lora_parameter_name(name):
            yield name, p


def mark_only_lora_trainable(model):
    """``requires_grad`` True for the adapter tensors, False for every other
    parameter of `model`. Returns the number of trainable parameters."""
    n = 0
    for raw, p in model.named_parameters():
        trainable = is_lora_parameter_name(_strip_wrappers(raw))
        p.requires_grad_(trainable)
        n += p.numel() if trainable else 0
    return n


def lora_state_dict(model, naming="megatron"):
    """``{name: tensor}`` of the adapter tensors (detached; the names as
    ``named_parameters()`` prints them, or in the planner's form with
    ``naming="planner"``)."""
    if naming not in ("megatron", "planner"):
        raise ValueError(f"lora_state_dict: naming must be 'megatron' or 'planner' (got {naming!r})")
    return {(n if naming == "megatron" else to_planner_name(n)): p.detach()
            for n, p in lora_parameters(model)}


def load_lora_state_dict(model, state_dict):
    """Copies adapter tensors into `model` (names in either form). Every adapter
    of the model must be given, with its shape, and nothing else: a missing,
    unexpected or mis-shaped tensor is an error naming it."""
    own = dict(lora_parameters(model))
    given = {from_planner_name(k): v for k, v in state_dict.items()}
    missing = sorted(set(own) - set(given))
    unexpected = sorted(set(given) - set(own))
    if missing or unexpected:
        raise KeyError(f"load_lora_state_dict: missing {missing[:5]}{'...' if len(missing) > 5 else ''}"
                       f", unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, p in own.items():
        src = given[name]
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"load_lora_state_dict: {name} has shape {tuple(src.shape)}, "
                             f"the model's {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(src)
