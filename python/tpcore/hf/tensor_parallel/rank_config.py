"""A model config as one rank's attention module sees it: a few fields per rank (its head
counts), everything else the model's own config.

Some attention forwards read head counts from `self.config` rather than from attributes of
their own (Phi-3 splits its fused q|k|v at `config.num_attention_heads * head_dim`). After
the split, those modules hold a `RankConfig` instead: reads of the per-rank fields give
this rank's counts; every other read, and every write, goes to the model's config, so a
later change there (`set_attn_implementation`, ...) still reaches the attention.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RankConfig"]


class RankConfig:
    """`config` with `fields` (name -> this rank's value) in place of its own values."""

    def __init__(self, config: Any, fields: dict[str, int]) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_fields", dict(fields))

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found on the instance; dunder lookups (copy, pickle)
        # and a half-built instance must not recurse into the model's config.
        if name.startswith("__") or name in ("_config", "_fields"):
            raise AttributeError(name)
        fields = self._fields
        return fields[name] if name in fields else getattr(self._config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._fields:
            raise AttributeError(
                f"tpcore.hf: {name} is this rank's share ({self._fields[name]}) of the model's; "
                "set it on model.config"
            )
        setattr(self._config, name, value)

    def __repr__(self) -> str:
        return f"RankConfig({self._fields}, of {type(self._config).__name__})"
