"""The distributed optimizer's state in a checkpoint: one file per (TP, PP, DP) rank, each
DP rank writing only the slices it owns (nothing is gathered), and the reading side, which
puts the slices of one saved (TP, PP) rank back together one tensor at a time, so that any
loader (any TP, PP and DP size, with or without the distributed optimizer) reads them as
it reads a plain checkpoint's optimizer state.

    optim_tpRR_ppSS_dpDDD.pt   {"shards": {name: {"lo", "hi", "numel", "exp_avg", "exp_avg_sq",
                                "step"[, "master"]}}, "identity": {...}}

`lo`/`hi` are the elements of the parameter's flattened TP piece (the tensor of the same
name in `model_tpRR_ppSS.pt`) that the 1-D tensors hold; the files of the DP ranks of one
(TP, PP) rank cover every element of every parameter exactly once. Mixture-of-experts
weights are sliced over the ranks holding the same experts instead, and their slices are in
files of their own (`expert_files`), read by the same `SavedSlices`.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator, Mapping

import torch

from .errors import CheckpointError
from .integrity import check_identity, verify_file

__all__ = ["optimizer_file", "is_sharded", "sharded_payload", "SavedSlices", "shard_slices"]


def optimizer_file(directory: str, tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return os.path.join(directory, f"optim_tp{tp_rank:02d}_pp{pp_rank:02d}_dp{dp_rank:03d}.pt")


def is_sharded(optimizer) -> bool:
    """Whether `optimizer` keeps only this DP rank's slices (the distributed optimizer)."""
    return optimizer is not None and hasattr(optimizer, "pieces") and hasattr(optimizer, "gather")


def sharded_payload(shards: dict, keep: Callable[[str], bool]) -> dict:
    """What a rank's optimizer file holds: of the distributed optimizer's `state_dict()
    ["shards"]`, the slices of the parameters `keep` accepts (not the last stage's copy of a
    tied embedding, stored with the first stage; the expert weights in the expert slice files,
    the rest in the DP ranks' files)."""
    return {"shards": {name: entry for name, entry in shards.items() if keep(name)}}


class _Assembled(Mapping):
    """ "name/key" -> that optimizer tensor of the saved TP piece, built from the DP slices
    when asked for (one tensor at a time, never the whole state)."""

    def __init__(self, slices: "SavedSlices", shapes: dict[str, torch.Size]) -> None:
        self.slices, self.shapes = slices, shapes

    def __getitem__(self, item: str) -> torch.Tensor:
        name, key = item.split("/", 1)
        return self.slices.assemble(name, key, self.shapes[name])

    def __iter__(self) -> Iterator[str]:
        return iter(
            f"{n}/{k}" for n in self.slices.names for k in self.slices.template(n) if k != "step"
        )

    def __len__(self) -> int:
        return sum(1 for _ in self)


class SavedSlices:
    """The optimizer slice files of one saved piece of the model (a (TP, PP) rank's
    parameters: `shard_slices`; an (EP, PP) rank's experts: `expert_files.expert_slices`),
    memory-mapped; each checked first (size + CRC-32 against the metadata unless `verify` is
    False, then `check_identity(path, state, slice rank)`) like the model shards."""

    def __init__(
        self,
        paths: list[str],
        meta: dict,
        verify: bool,
        load: Callable[..., dict],
        check_identity: Callable[[str, dict, int], None],
    ) -> None:
        self.paths = paths
        missing = [os.path.basename(p) for p in self.paths if not os.path.isfile(p)]
        if missing:
            raise CheckpointError(
                f"tpcore: checkpoint {os.path.dirname(paths[0])} is incomplete: "
                f"{', '.join(missing)} missing (distributed optimizer state)"
            )
        self.states = []
        for d, path in enumerate(self.paths):
            if verify:
                verify_file(path, meta["files"])
            state = load(path, mmap=True)
            check_identity(path, state, d)
            self.states.append(state)
        self.where: dict[str, list[tuple[int, int, int]]] = {}  # name -> [(slice, lo, hi)]
        for d, state in enumerate(self.states):
            for name, entry in state["shards"].items():
                self.where.setdefault(name, []).append((d, int(entry["lo"]), int(entry["hi"])))
        self.names = list(self.where)

    def check_names(self, stored: list[str], numels: dict[str, int]) -> None:
        """The slices hold exactly the parameters `stored`, each element once."""
        missing, extra = (
            sorted(set(stored) - set(self.where)),
            sorted(set(self.where) - set(stored)),
        )
        if missing or extra:
            raise CheckpointError(
                f"tpcore: {self.paths[0]} (and its peer slices): optimizer state does not fit the "
                f"model (missing {missing[:5]}, unexpected {extra[:5]})"
            )
        for name in stored:
            spans = sorted((lo, hi) for _, lo, hi in self.where[name])
            ends = [0] + [hi for _, hi in spans]
            if [lo for lo, _ in spans] != ends[:-1] or ends[-1] != numels[name]:
                raise CheckpointError(
                    f"tpcore: {self.paths[0]} (and its peer slices): the slices of {name} "
                    f"({spans}) do not cover its {numels[name]} elements once each"
                )

    def template(self, name: str) -> dict:
        """The keys of `name`'s state: tensors of the saved dtype (for their dtype only), "step"."""
        d, _, _ = self.where[name][0]
        entry = self.states[d]["shards"][name]
        return {k: v for k, v in entry.items() if k not in ("lo", "hi", "numel")}

    def assemble(self, name: str, key: str, shape: torch.Size) -> torch.Tensor:
        out = None
        for d, lo, hi in self.where[name]:
            piece = self.states[d]["shards"][name][key]
            if out is None:
                out = torch.empty(shape.numel(), dtype=piece.dtype)
            out[lo:hi] = piece
        return out.view(shape)

    def pieces(self, shapes: dict[str, torch.Size]) -> Mapping[str, torch.Tensor]:
        return _Assembled(self, shapes)

    def read_as(
        self, model: Mapping[str, torch.Tensor], stored: list[str], wanted: list[str]
    ) -> tuple[dict, Callable[[dict], Mapping[str, torch.Tensor]]]:
        """For a model (or expert) file whose optimizer state these slices hold: once they
        are checked to cover the file's `stored` tensors (`model`) exactly, the saved state of
        `wanted` as a plain file's ({"params": {name: template}}) and the section function
        that `copy_from` reads the assembled tensors through."""
        shapes = {name: model[name].shape for name in stored}
        self.check_names(stored, {name: shape.numel() for name, shape in shapes.items()})
        saved = {"params": {name: self.template(name) for name in wanted}}
        return saved, lambda _state: self.pieces(shapes)


def shard_slices(
    directory: str, meta: dict, tp_rank: int, pp_rank: int, verify: bool, load: Callable[..., dict]
) -> SavedSlices:
    """The DP ranks' optimizer files of saved (TP rank, PP rank)."""
    paths = [
        optimizer_file(directory, tp_rank, pp_rank, d) for d in range(meta["data_parallel_size"])
    ]

    def check(path: str, state: dict, dp_rank: int) -> None:
        check_identity(path, state, meta, tp_rank, pp_rank, dp_rank=dp_rank)

    return SavedSlices(paths, meta, verify, load, check)
