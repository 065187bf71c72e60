"""The pieces of a plan: where each parameter's slice comes from (`Load`), what becomes of
one module (`Replacement`), the head counts of the dense model and of this rank
(`HeadLayout`), and the size checks shared by every role."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ...tensor_parallel.shard_spec import Part, ShardSpec

__all__ = [
    "Load",
    "Replacement",
    "HeadLayout",
    "chunk",
    "linear_shape",
    "split_spec",
    "spec_ranges",
]


@dataclass(frozen=True)
class Load:
    """Where one parameter of the parallel model comes from in the dense state dict."""

    key: str
    """The parameter's name in the dense model / checkpoint."""
    dim: int | None = None
    """The dim of the stored tensor that is cut; None: the whole tensor."""
    ranges: tuple[tuple[int, int], ...] = ()
    """`[start, stop)` ranges along `dim`, concatenated in order."""
    rows: int | None = None
    """Zero-pad dim 0 of the result to this many rows (vocab padding)."""
    transpose: bool = False
    """Transpose the 2-D result (GPT-2's Conv1D stores weights `[in, out]`)."""
    spec: ShardSpec | None = None
    """The shard spec of the parameter made (its orientation, this rank's placement, no group)."""


@dataclass
class Replacement:
    """One module to replace (column / row / embedding / head / norm), or to keep with its
    parameters cut (per_head / experts)."""

    name: str
    role: str
    in_features: int
    out_features: int
    """For column layers the size the tpcore layer is built with (tp x this rank's rows)."""
    bias: bool
    loads: dict[str, Load]
    """Parameter attribute ("weight", "bias") -> its slice."""
    padding_idx: int | None = None
    vocab_size: int | None = None
    kv_replicated: bool = False
    """Column layer of KV heads copied on several ranks (TP > KV heads)."""
    kv_rows: tuple[int, int] | None = None
    """With `kv_replicated`: `[start, stop)` of this rank's output rows that are KV copies
    (the k and v blocks of a fused q|k|v layer); None: every row."""
    embed_scale: float | None = None
    """The constant a scaled word embedding multiplies its lookup by (Gemma's)."""
    eps: float | None = None
    """A split norm's epsilon."""
    weight_after_cast: bool = False
    """A split norm that multiplies by its weight after casting back to the input dtype
    (OLMoE's)."""


@dataclass(frozen=True)
class HeadLayout:
    """Head counts of the dense model and of this rank."""

    heads: int
    kv_heads: int
    head_dim: int
    tp_size: int
    tp_rank: int

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp_size

    @property
    def kv_replicated(self) -> bool:
        """TP is larger than the KV head count: each rank keeps a copy of the one KV head its
        queries use."""
        return self.kv_heads % self.tp_size != 0

    @property
    def local_kv_heads(self) -> int:
        return 1 if self.kv_replicated else self.kv_heads // self.tp_size

    def kv_head_ranges(self) -> tuple[tuple[int, int], ...]:
        """This rank's KV heads as a `[start, stop)` range of output features."""
        if self.kv_replicated:
            first = self.tp_rank * self.local_heads * self.kv_heads // self.heads
        else:
            first = self.tp_rank * self.local_kv_heads
        return ((first * self.head_dim, (first + self.local_kv_heads) * self.head_dim),)

    def head_range(self, kind: str) -> tuple[int, int]:
        """This rank's `[start, stop)` of the output features of a projection of the query
        heads ("heads") or of the KV heads ("kv_heads")."""
        if kind == "heads":
            width = self.local_heads * self.head_dim
            return self.tp_rank * width, (self.tp_rank + 1) * width
        return self.kv_head_ranges()[0]

    def attribute(self, kind: str) -> int:
        return {
            "heads": self.local_heads,
            "kv_heads": self.local_kv_heads,
            "width": self.local_heads * self.head_dim,
            "kv_groups": self.local_heads // self.local_kv_heads,
        }[kind]


def chunk(size: int, tp_size: int, tp_rank: int, what: str) -> tuple[int, int]:
    if size % tp_size:
        raise ValueError(
            f"tpcore.hf: {what} ({size}) is not divisible by tensor_parallel_size {tp_size}"
        )
    step = size // tp_size
    return tp_rank * step, (tp_rank + 1) * step


def linear_shape(name: str, module: nn.Module) -> tuple[int, int, bool]:
    """(in_features, out_features, stored transposed) of an nn.Linear or HF's Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ == "Conv1D" and hasattr(module, "nx"):
        return module.nx, module.nf, True
    raise ValueError(
        f"tpcore.hf: module {name!r} is a {type(module).__name__}, expected nn.Linear or Conv1D"
    )


def split_spec(
    shape: tuple[int, ...],
    dim: int | None,
    layout: HeadLayout,
    parts: tuple[tuple[str, int, int], ...] = (),
    *,
    vocab: bool = False,
) -> ShardSpec:
    """The shard spec, on this rank of `layout`, of a parameter of global `shape` split along
    `dim` (None: replicated) into `parts` (name, size, units) or cut by vocabulary rows."""
    placement = dict(tp_size=layout.tp_size, tp_rank=layout.tp_rank)
    if dim is None:
        return ShardSpec(tuple(shape), **placement)
    if vocab:
        return ShardSpec(tuple(shape), 0, vocab_multiple=1, **placement)
    return ShardSpec(tuple(shape), dim, tuple(Part(*p) for p in parts), **placement)


def spec_ranges(spec: ShardSpec) -> tuple[tuple[int, int], ...]:
    """The `[start, stop)` ranges of the global tensor this rank's piece holds, in order."""
    return tuple((start, start + n) for _, start, n in spec.ranges()[1])
