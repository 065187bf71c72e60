"""Checkpoints of tpcore models. `dcp`: any model made of tpcore layers in torch's
distributed checkpoint (DCP), resharded to any TP size through the shard specs. (The GPT
trainer's own format lives in `tpcore.train.checkpoint`.)

Activation recompute, which `tpcore.checkpoint` was before, is `tpcore.recompute`.
"""

from .dcp import (
    load_sharded_optimizer_state_dict,
    load_sharded_state_dict,
    sharded_optimizer_state_dict,
    sharded_state_dict,
)

__all__ = [
    "sharded_state_dict",
    "load_sharded_state_dict",
    "sharded_optimizer_state_dict",
    "load_sharded_optimizer_state_dict",
]
