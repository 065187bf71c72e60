"""`parallelize` (a dense model in memory) and `from_pretrained` (each rank reads only its
slices of a saved model): both replace the modules a policy names by tpcore layers built
on the meta device, then fill every new parameter with its slice of the dense weight.
The layers' own initialisation never runs, so it does not matter how it draws.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ... import comm
from ..._module_utils import SharesProcessGroups
from ...models.split_norm import SplitRMSNorm
from ...parallel_state import resolve_tensor_group
from ...tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ScaledVocabParallelEmbedding,
    VocabParallelEmbedding,
)
from ...tensor_parallel.shard_spec import ShardSpec, set_shard_spec
from .grads import install_gradient_sums
from .lm_head import VocabParallelLMHead
from .moe import install_moe_blocks
from .peft_lora import attach_adapters, inner_model, is_peft_model, take_adapters
from .plan import Load, Plan, Replacement, make_plan
from .policy import get_policy
from .rank_config import RankConfig
from .slices import spec_ranges
from .weights import BLOCK_BYTES, DenseSource, SafetensorsSource

__all__ = ["parallelize", "from_pretrained"]

_TPCORE_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def _build_layer(rep: Replacement, group: dist.ProcessGroup, dtype: torch.dtype) -> nn.Module:
    """The tpcore layer for `rep`, its parameters on the meta device."""
    common = dict(group=group, dtype=dtype, device="meta")
    if rep.role == "column":
        return ColumnParallelLinear(rep.in_features, rep.out_features, rep.bias, **common)
    if rep.role == "row":
        return RowParallelLinear(
            rep.in_features, rep.out_features, rep.bias, input_is_parallel=True, **common
        )
    if rep.role == "norm":
        return SplitRMSNorm(
            rep.out_features, rep.eps, weight_after_cast=rep.weight_after_cast, **common
        )
    if rep.role == "embedding":
        args = (rep.in_features, rep.out_features)
        common.update(padding_idx=rep.padding_idx, make_vocab_size_divisible_by=1)
        if rep.embed_scale is not None:
            return ScaledVocabParallelEmbedding(*args, embed_scale=rep.embed_scale, **common)
        return VocabParallelEmbedding(*args, **common)
    return VocabParallelLMHead(
        rep.in_features, rep.out_features, rep.bias, vocab_size=rep.vocab_size, **common
    )


# Roles whose module is kept, its parameters cut (see plan.py).
_KEPT = ("per_head", "experts", "shared")


def _kept_shape(param: nn.Parameter, load: Load) -> nn.Parameter:
    """A meta parameter shaped like `param` cut by `load` (along `load.dim`)."""
    shape = list(param.shape)
    shape[load.dim] = sum(hi - lo for lo, hi in load.ranges)
    return nn.Parameter(torch.empty(shape, device="meta"))


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, child = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), child


def _set_parameter(
    module: nn.Module, attr: str, value: torch.Tensor, like: nn.Parameter, requires_grad: bool
) -> nn.Parameter:
    """Put `value` in `module.attr` as a Parameter carrying `like`'s tpcore attributes and the
    replaced parameter's `requires_grad` (a frozen weight stays frozen)."""
    if tuple(value.shape) != tuple(like.shape):
        raise RuntimeError(
            f"tpcore.hf: slice for {type(module).__name__}.{attr} has shape {list(value.shape)}, "
            f"the layer expects {list(like.shape)}"
        )
    param = nn.Parameter(value, requires_grad=requires_grad)
    param.__dict__.update(like.__dict__)
    module._parameters[attr] = param
    return param


_COPYABLE: dict[type, type] = {}


def _keep_attributes_on_copy(module: nn.Module) -> None:
    """Make `copy.deepcopy` of a kept module (its parameters cut, not replaced) keep the
    shard specs on its parameters, as tpcore's own layers do (`SharesProcessGroups`):
    torch's Parameter copy drops them. Its class becomes a subclass of the same name."""
    cls = type(module)
    if not isinstance(module, SharesProcessGroups):
        if cls not in _COPYABLE:
            _COPYABLE[cls] = type(
                cls.__name__,
                (SharesProcessGroups, cls),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
            )
        module.__class__ = _COPYABLE[cls]


def _checked_spec(name: str, attr: str, load: Load) -> ShardSpec:
    """`load`'s shard spec, checked to hold exactly the ranges the load reads (the plan
    writes both; a disagreement is a bug in it, caught before any training)."""
    spec = load.spec
    if spec is None:
        raise RuntimeError(f"tpcore.hf: the plan gives {name}.{attr} no shard spec")
    read = tuple(r for r in load.ranges if r[1] > r[0]) if load.dim is not None else ()
    held = spec_ranges(spec) if spec.kind != "replicated" else ()
    if read != held:
        raise RuntimeError(
            f"tpcore.hf: {name}.{attr}: the plan reads {list(read)} but its shard spec holds "
            f"{list(held)}"
        )
    return spec


def _swap_parameters(model: nn.Module, new_of: dict[int, nn.Parameter]) -> None:
    """Point every module attribute that held an old parameter at its replacement (keeps ties)."""
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is not None and id(p) in new_of:
                module._parameters[attr] = new_of[id(p)]


def _names_by_parameter(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has (tied parameters have several)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _in_source(load: Load, aliases: list[str], source) -> Load:
    """`load` under the first of its names the source holds (a checkpoint keeps one name of a
    tied tensor)."""
    key = next((name for name in [load.key, *aliases] if name in source), load.key)
    return dataclasses.replace(load, key=key)


def _apply(
    model: nn.Module,
    plan: Plan,
    group: dist.ProcessGroup,
    source,
    dtype: torch.dtype | None,
    device,
) -> None:
    """Replace the planned modules and fill their parameters from `source`."""
    aliases = _names_by_parameter(model)
    new_of: dict[int, nn.Parameter] = {}  # id(old parameter) -> new parameter
    keep_alive = []  # old parameters, so their ids stay unique until the swap
    for rep in plan.replacements:
        parent, child = _parent(model, rep.name)
        old = getattr(parent, child)
        if rep.role in _KEPT:  # the module stays; its parameters become this rank's slices
            layer = old
            shapes = {
                attr: _kept_shape(getattr(old, attr), load) for attr, load in rep.loads.items()
            }
        else:
            layer = _build_layer(rep, group, dtype or old.weight.dtype)
            shapes = layer._parameters
        for attr, load in rep.loads.items():
            old_param, meta = getattr(old, attr), shapes[attr]
            # tied to a parameter replaced before (the head to the embedding)
            if id(old_param) in new_of:
                shared = new_of[id(old_param)]
                if shared.shape != meta.shape:
                    raise RuntimeError(
                        f"tpcore.hf: {rep.name}.{attr} is tied to a parameter of shape "
                        f"{list(shared.shape)}, the layer expects {list(meta.shape)}"
                    )
                layer._parameters[attr] = shared
                continue
            target_device = device if device is not None else old_param.device
            if target_device.type == "meta":
                raise RuntimeError(
                    f"tpcore.hf: {rep.name}.{attr} is on the meta device and no device was given"
                )
            load = _in_source(load, aliases[id(old_param)], source)
            param = _set_parameter(
                layer,
                attr,
                source.read(load, dtype or old_param.dtype, target_device),
                meta,
                old_param.requires_grad,
            )
            set_shard_spec(
                param,
                _checked_spec(rep.name, attr, load).at(load.spec.tp_size, load.spec.tp_rank, group),
            )
            new_of[id(old_param)] = param
            keep_alive.append(old_param)
        if rep.role in _KEPT:
            _keep_attributes_on_copy(layer)
        setattr(parent, child, layer)
    _swap_parameters(model, new_of)
    for name, attribute, value in plan.attributes:
        setattr(model.get_submodule(name), attribute, value)
    for name, fields in plan.configs:
        module = model.get_submodule(name)
        module.config = RankConfig(module.config, fields)
    model.tpcore_plan = plan
    _refuse_save_pretrained(model)


def _save_pretrained_refused(cls: str, *args, **kwargs) -> None:
    raise NotImplementedError(
        f"tpcore.hf: save_pretrained of a {cls} split by tpcore.hf would write one rank's slices "
        "under the full model's names; call tpcore.hf.save_pretrained(model, path) on every rank "
        "instead (the whole model, or a PeftModel's adapters as PEFT saves them)"
    )


def _refuse_save_pretrained(model: nn.Module) -> None:
    """Make `save_pretrained` (and `push_to_hub`, which calls it) of the split model and of
    its transformers submodules raise instead of writing a folder that only looks right.
    A partial of a module-level function: copy.deepcopy and pickle keep it."""
    for module in model.modules():
        if callable(getattr(module, "save_pretrained", None)):
            module.save_pretrained = functools.partial(
                _save_pretrained_refused, type(module).__name__
            )


def _check_not_parallel(model: nn.Module) -> None:
    if any(isinstance(m, _TPCORE_LAYERS) for m in model.modules()):
        raise ValueError(
            f"tpcore.hf: {type(model).__name__} already holds tpcore layers (parallelized twice?)"
        )


def _weight_fingerprints(model: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Every parameter's name and (sum, sum of squares) in float64, `[P, 2]`, read in
    blocks (no float64 copy of a whole embedding)."""
    names, rows = [], []
    for name, p in model.named_parameters():
        flat, total, squares = p.detach().reshape(-1), 0.0, 0.0
        for block in flat.split(1 << 22):
            block = block.double()
            total, squares = total + block.sum(), squares + block.square().sum()
        names.append(name)
        rows.append(
            torch.stack(
                [
                    torch.as_tensor(total, dtype=torch.float64),
                    torch.as_tensor(squares, dtype=torch.float64),
                ]
            )
        )
    return names, torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def _check_same_weights(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Raise on every rank alike unless every rank of `group` holds the same weights: each
    keeps its own slice, so different models (an unseeded init) would silently combine
    into one that no rank had. One all-gather of two float64s per parameter."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    names, mine = _weight_fingerprints(model)
    # The counts first: models with different parameters would all-gather different sizes.
    counts = comm.all_gather(torch.tensor([len(names)], device=device), 0, group).tolist()
    if len(set(counts)) > 1:
        raise ValueError(
            f"tpcore.hf: parallelize: the ranks hold different models ({counts} parameters on "
            f"ranks 0..{world - 1})"
        )
    everyone = comm.all_gather(mine.to(device), 0, group).view(world, -1, 2).cpu()
    # Summation order can differ with the thread count: equal within float64 rounding.
    same = (
        torch.isclose(everyone, everyone[0], rtol=1e-9, atol=0.0, equal_nan=True)
        .all(dim=2)
        .all(dim=0)
    )
    if not bool(same.all()):
        differing = [n for n, ok in zip(names, same.tolist()) if not ok]
        raise ValueError(
            f"tpcore.hf: parallelize: the ranks hold different weights ({len(differing)} of "
            f"{len(names)} parameters differ, e.g. {differing[:3]}); build or load the model the "
            "same way on every rank (seed the initialization, or load it with from_pretrained)"
        )


def parallelize(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Split a dense transformers model over the tensor-parallel group, in place.

    Call on every rank of the group with the same model (same weights: checked, every
    rank raises alike if they differ). The policy of `model.config.model_type` names the
    modules that become column / row-parallel linears, the vocab-parallel embedding and the
    vocab-parallel LM head; the attention modules get this rank's head counts. Returns
    `model`, whose `forward` and `generate` give the dense results on every rank (logits
    gathered over the vocabulary).
    Sizes that cannot be split raise a ValueError before any weight moves.

    A PEFT `PeftModel` with LoRA adapters (`peft.get_peft_model`) is split with them: each
    adapted layer gets a `LoRAAdapter` holding its slices of PEFT's A and B (`peft_lora.py`);
    the PeftModel is returned, and `tpcore.hf.save_pretrained` writes its adapters for PEFT.
    """
    if is_peft_model(model):
        return _parallelize_peft(model, group)
    get_policy(model.config)  # an unsupported architecture fails first, even without groups
    group = resolve_tensor_group(group)
    _check_not_parallel(model)
    plan = make_plan(model, dist.get_world_size(group), dist.get_rank(group))
    _check_same_weights(model, group)
    _split(model, plan, group)
    return model


def _split(model: nn.Module, plan: Plan, group: dist.ProcessGroup) -> None:
    tensors = dict(model.named_parameters(remove_duplicate=False))
    _apply(model, plan, group, DenseSource(tensors), None, None)
    install_gradient_sums(model, group)
    install_moe_blocks(model, group)


def _parallelize_peft(model: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    """`parallelize` of a PeftModel: its LoRA layers out, the plain model split, the adapters
    back in as slices. Anything unsupported raises before the model changes."""
    inner = inner_model(model)
    get_policy(inner.config)
    group = resolve_tensor_group(group)
    _check_not_parallel(inner)
    _check_same_weights(inner, group)  # the adapters' A and B included
    wrappers = {n: m for n, m in inner.named_modules() if hasattr(m, "lora_A")}
    inner, config, adapters = take_adapters(model)
    try:
        plan = make_plan(inner, dist.get_world_size(group), dist.get_rank(group))
    except Exception:
        for name, wrapper in wrappers.items():  # as it was: PEFT's layers back in place
            parent, _, child = name.rpartition(".")
            setattr(inner.get_submodule(parent), child, wrapper)
        raise
    _split(inner, plan, group)
    attach_adapters(inner, config, adapters)
    _refuse_save_pretrained(model)
    return model


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built in this block put their parameters on the meta device; buffers (rotary
    frequencies, position ids) stay real, as they are computed, not loaded."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _config_dtype(config, dtype) -> torch.dtype:
    if dtype is None:
        dtype = (
            getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        )
    given = dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(
            f"tpcore.hf: dtype must be float32, bfloat16, float16 or float64, got {given!r}"
        )
    return dtype


def _model_class(config, model_class):
    import transformers

    if model_class is not None:
        return getattr(transformers, model_class) if isinstance(model_class, str) else model_class
    names = getattr(config, "architectures", None) or []
    if not names or not hasattr(transformers, names[0]):
        raise ValueError(
            f"tpcore.hf: the config names no known architecture ({names}); pass model_class="
        )
    return getattr(transformers, names[0])


def _default_device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_persistent(model: nn.Module, name: str) -> bool:
    owner, attr = _parent(model, name)
    return attr not in owner._non_persistent_buffers_set


def _check_shapes(model: nn.Module, source: SafetensorsSource, path: str) -> None:
    """Every tensor of the checkpoint that the model has must have the shape config.json
    gives it. Checked from the headers before any weight is read: a contradiction made one
    rank fail cutting its slice (an expand error) while another went on into a collective."""
    wrong, seen, lacking = [], set(), []
    buffers = [
        (name, b) for name, b in model.named_buffers() if _is_persistent(model, name)
    ]  # what _load_rest loads
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *buffers]:
        key = source.resolve(name) or source.resolve_experts(name)
        # experts stored one by one (or not at all)
        if source.resolve(name) is None and tensor.dim():
            lacking += source.missing_experts(name, tensor.shape[0])
        if key is None or key in seen:  # not stored (tied, computed buffer) or already checked
            continue
        seen.add(key)
        found, file = source.stored_shape(key)
        if found != list(tensor.shape):
            wrong.append(f"{key!r} is {found} in {file} but the config gives {list(tensor.shape)}")
    if lacking:  # before the shapes: the experts after a gap would read as another expert count
        more = f" and {len(lacking) - 8} more" if len(lacking) > 8 else ""
        raise KeyError(
            f"tpcore.hf: {path} lacks {len(lacking)} tensor(s) of experts stored one by one: "
            f"{lacking[:8]}{more} (a partial download, or an index.json that leaves them out)"
        )
    if wrong:
        more = f"; and {len(wrong) - 4} more" if len(wrong) > 4 else ""
        raise ValueError(
            f"tpcore.hf: {os.path.join(path, 'config.json')} contradicts the weights: {len(wrong)} "
            "tensor(s) differ: " + "; ".join(wrong[:4]) + more
        )


def _warn_unexpected(model: nn.Module, source: SafetensorsSource, path: str) -> None:
    """Warn, naming them, about the checkpoint's tensors that the model does not read, as
    transformers reports its unexpected keys (and skips those its model class says to
    ignore). A warning, not an error: transformers loads such folders too (a multi-token
    prediction head, a base model read from a checkpoint with a head), and a split model
    should load what the dense one loads; but a config.json with fewer layers than the
    weights must not pass unnoticed."""
    used: set[str] = set()
    for name, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        used.update(source.stored_keys(name))
    ignored = [
        re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    ]
    unexpected = sorted(
        k for k in source.files if k not in used and not any(p.search(k) for p in ignored)
    )
    if unexpected:
        more = f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
        warnings.warn(
            f"tpcore.hf: {len(unexpected)} tensor(s) of {path} are unexpected (the model that "
            "config.json describes has no such parameter) and not loaded, as transformers does not "
            f"load them: {unexpected[:8]}{more}. Does config.json give fewer layers "
            "(num_hidden_layers) than the weights hold?",
            stacklevel=3,
        )


def _same_stored(source: SafetensorsSource, a: str, b: str, dtype: torch.dtype) -> bool:
    """Whether checkpoint tensors `a` and `b` are equal in `dtype` (as loaded), read a block
    of rows at a time: no whole copy of an embedding table."""
    shape = source.files[a].shape(a)
    if shape != source.files[b].shape(b):
        return False

    def read(key: str, dim: int | None, ranges: list[tuple[int, int]]) -> torch.Tensor:
        return source.files[key].read(key, dim, ranges).to(dtype)

    if not shape:
        return torch.equal(read(a, None, []), read(b, None, []))
    rows = max(
        1, BLOCK_BYTES // max(1, 8 * math.prod(shape[1:]))
    )  # a block of at most BLOCK_BYTES in float64
    return all(
        torch.equal(
            read(a, 0, [(lo, min(lo + rows, shape[0]))]),
            read(b, 0, [(lo, min(lo + rows, shape[0]))]),
        )
        for lo in range(0, shape[0], rows)
    )


def _untie_differing(
    model: nn.Module, source: SafetensorsSource, dtype: torch.dtype, path: str
) -> None:
    """A config.json that ties weights (`tie_word_embeddings`) beside a checkpoint that stores
    both tied tensors, with different values: transformers >= 5 keeps each as saved (it
    unties them and warns); earlier releases tie them, the first (the embedding) winning.
    Do what the installed transformers does, and warn either way (a config edited by hand
    is the usual cause). Each rank compares the same files alike: no collective."""
    import transformers

    tied = getattr(
        model, "all_tied_weights_keys", None
    )  # transformers >= 5: {target: source}, what it unties
    if tied is not None:
        pairs = list(tied.items())
    else:
        pairs = [
            (name, names[0]) for names in _names_by_parameter(model).values() for name in names[1:]
        ]
    for target, origin in pairs:
        a, b = source.resolve(origin), source.resolve(target)
        if a is None or b is None or a == b or _same_stored(source, a, b, dtype):
            continue
        if tied is None:
            what = f"{target!r} is tied to {origin!r} and the checkpoint's {target!r} is not loaded"
        else:
            owner, attr = _parent(model, target)
            old = owner._parameters[attr]
            owner._parameters[attr] = nn.Parameter(
                torch.empty_like(old, device="meta"), requires_grad=old.requires_grad
            )
            tied.pop(target)
            what = "both are loaded as saved, untied"
        warnings.warn(
            f"tpcore.hf: {os.path.join(path, 'config.json')} ties {target!r} to {origin!r} "
            f"(tie_word_embeddings), but the checkpoint holds both with different values: {what}, "
            f"as transformers {transformers.__version__} does. Set tie_word_embeddings to false in "
            "config.json to keep the saved head without this warning",
            stacklevel=3,
        )


def _load_rest(
    model: nn.Module, source: SafetensorsSource, dtype: torch.dtype, device: torch.device
) -> None:
    """Fill the parameters left on meta (norms, position embeddings...) and the persistent
    buffers."""
    aliases = _names_by_parameter(model)
    new_of: dict[int, nn.Parameter] = {}
    missing = []
    for name, p in list(model.named_parameters()):
        if p.device.type != "meta":
            continue
        owner, attr = _parent(model, name)
        load = _in_source(Load(name), aliases[id(p)], source)
        if load.key not in source:
            missing.append(name)
            continue
        new_of[id(p)] = _set_parameter(
            owner, attr, source.read(load, dtype, device), p, p.requires_grad
        )
    if missing:
        raise KeyError(
            f"tpcore.hf: the checkpoint lacks {len(missing)} parameter(s): {missing[:8]}"
        )
    _swap_parameters(model, new_of)
    for name, buffer in model.named_buffers():
        owner, attr = _parent(model, name)
        if attr not in owner._non_persistent_buffers_set and name in source:
            owner._buffers[attr] = source.read(Load(name), buffer.dtype, device)
    model.to(device)  # the computed buffers


def from_pretrained(
    path: str,
    *,
    tensor_parallel_size: int | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
    model_class=None,
) -> nn.Module:
    """Load a `save_pretrained` folder split over the tensor-parallel group.

    Each rank reads only its own slices from the safetensors file(s), so its peak host
    memory is about model size / TP plus one block (`weights.BLOCK_BYTES`), never the
    whole model. `dtype` defaults to the config's dtype (else float32); `device` to the
    current CUDA device with NCCL, else CPU; `model_class` (a transformers class or its
    name) to `config.architectures[0]`. `tensor_parallel_size`, when given, must equal
    the group's size. Call on every rank of the group.
    """
    from transformers import AutoConfig, GenerationConfig

    # Checked here, not by transformers: it takes a missing folder for a hub repo id
    # ("Repo id must be in the form 'repo_name'..."), and this reads local files only.
    if not os.path.isdir(path):
        what = "is a file, not" if os.path.exists(path) else "does not exist; expected"
        raise FileNotFoundError(
            f"tpcore.hf: {path} {what} a save_pretrained folder (a hub model: download it first, "
            "e.g. huggingface_hub.snapshot_download)"
        )
    if not os.path.isfile(
        os.path.join(path, "config.json")
    ):  # transformers: "Unrecognized model ... Should have a `model_type` key"
        raise FileNotFoundError(
            f"tpcore.hf: {path} has no config.json (a partial download, or not a save_pretrained "
            "folder)"
        )
    group = resolve_tensor_group(group)
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if tensor_parallel_size is not None and tensor_parallel_size != tp:
        raise ValueError(
            f"tpcore.hf: tensor_parallel_size={tensor_parallel_size} but the tensor-parallel group "
            f"has {tp} ranks"
        )
    config = AutoConfig.from_pretrained(path)
    get_policy(config)
    cls, dtype = _model_class(config, model_class), _config_dtype(config, dtype)
    device = torch.device(device) if device is not None else _default_device(group)
    with _parameters_on_meta(), _default_dtype(dtype):
        model = cls(config)
    plan = make_plan(model, tp, rank)  # every size checked before any weight is read
    source = SafetensorsSource(
        path,
        getattr(model, "base_model_prefix", ""),
        plan.policy.checkpoint_renames,
        plan.policy.expert_parts,
    )
    _check_shapes(model, source, path)  # headers only: every rank raises alike, before any read
    _warn_unexpected(model, source, path)
    _untie_differing(model, source, dtype, path)
    _apply(model, plan, group, source, dtype, device)
    _load_rest(model, source, dtype, device)
    install_gradient_sums(model, group)  # after _load_rest: it makes the norms' parameters
    install_moe_blocks(model, group)
    if getattr(model, "can_generate", lambda: False)():
        try:
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: keep the one made from the config
            pass
    return model.eval()
