"""Checkpoints of tpcore models, both formats reading the shard specs:

- `dcp`: any model made of tpcore layers in torch's distributed checkpoint (DCP)
  (`sharded_state_dict`, `load_sharded_state_dict` and the optimizer's), resharded by DCP.
- tpcore's GPT format (`save`, `load`, `index`, `integrity`, `optimizer_slices`): one file per
  (TP, PP) rank with checksums and shard identity, atomic saves, loading at any TP x PP x
  virtual layout with only the shared index ranges read (`docs/checkpoint_format.md`).

Activation recompute, which `tpcore.checkpoint` was before, is `tpcore.recompute`.
"""

from .dcp import (
    load_sharded_optimizer_state_dict,
    load_sharded_state_dict,
    sharded_optimizer_state_dict,
    sharded_state_dict,
)
from .errors import CheckpointError

__all__ = [
    "sharded_state_dict",
    "load_sharded_state_dict",
    "sharded_optimizer_state_dict",
    "load_sharded_optimizer_state_dict",
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "load_dense_state_dict",
    "find_checkpoint",
    "require_checkpoint",
    "read_metadata",
]

_GPT_FORMAT = {
    "save_checkpoint": "save",
    "load_checkpoint": "load",
    "load_dense_state_dict": "load",
    "find_checkpoint": "index",
    "require_checkpoint": "index",
    "read_metadata": "index",
}


def __getattr__(name: str):
    # The GPT format imports the models and the pipeline code: loaded on first use, so that
    # `import tpcore` (which imports the DCP functions from here) stays light.
    if name in _GPT_FORMAT:
        import importlib

        return getattr(importlib.import_module(f".{_GPT_FORMAT[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
