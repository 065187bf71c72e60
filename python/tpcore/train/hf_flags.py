"""The trainer's `--load-hf PATH` and `--save-hf DIR`.

`--load-hf`: the model's architecture comes from PATH/config.json. A model flag given on
the command line or in `--config` that contradicts the folder raises, naming both (built
in Python, a TrainArgs field set away from its default does); the others take the folder's.
Run-time choices (dropout, sequence parallelism, recompute, the fused head + loss) stay with
the flags. The tokenizer is the folder's tokenizer.json unless `--tokenizer` names another;
the first step starts from the folder's weights (each rank reads its slices) unless `--load`
resumes a checkpoint.
`--save-hf`: at the end, the model is exported there (`hf.gpt_bridge.export_hf`); before training
starts, the architecture is checked to fit a Hugging Face family, and the folder to be
none of the run's other folders (the `--load-hf` model would be overwritten by its own
export) and to hold no files but an earlier export's (`hf.gpt_bridge.export.check_export_folder`:
another model's files would be left beside this one).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Sequence

from .._paths import inside, same_folder
from ..hf.gpt_bridge.config import config_from_hf, read_hf_config
from ..models import GPTConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "check_given_flags",
    "apply_hf_architecture",
    "hf_model_config",
    "check_tokenizer_fits",
    "load_initial_hf_weights",
    "save_hf",
    "check_save_hf_paths",
    "check_save_hf_folder",
]

# TrainArgs model flag -> its value for a GPTConfig.
_FLAGS: dict[str, Callable[[GPTConfig], object]] = {
    "num_layers": lambda c: c.num_layers,
    "hidden_size": lambda c: c.hidden_size,
    "num_attention_heads": lambda c: c.num_attention_heads,
    "num_kv_heads": lambda c: c.num_kv_heads,
    "ffn_hidden_size": lambda c: c.ffn_hidden_size,
    "kv_channels": lambda c: (
        c.head_dim
    ),  # the width itself: --kv-channels 128 agrees with a head_dim of 128 = H / heads
    "qk_layernorm": lambda c: c.qk_norm,
    "qk_norm_scope": lambda c: c.qk_norm_scope,
    "max_position_embeddings": lambda c: c.max_position_embeddings,
    "norm": lambda c: c.norm,
    "activation": lambda c: c.activation,
    "position_embedding": lambda c: c.position_embedding,
    "untie_embeddings": lambda c: not c.tie_embeddings,
    "embedding_scale": lambda c: c.embedding_scale,
    "disable_bias": lambda c: not c.bias,
    # A dense folder gives each MoE flag's default.
    "num_experts": lambda c: c.num_experts,
    "moe_router_topk": lambda c: c.moe_router_topk,
    "moe_ffn_hidden_size": lambda c: c.moe_ffn_hidden_size,
    "moe_shared_expert_intermediate_size": lambda c: c.moe_shared_expert_intermediate_size,
    "moe_shared_expert_gate": lambda c: c.moe_shared_expert_gate,
    "moe_layer_freq": lambda c: (
        ",".join(map(str, c.moe_layer_freq))
        if isinstance(c.moe_layer_freq, list)
        else str(c.moe_layer_freq)
    ),
    "moe_router_score_function": lambda c: c.moe_router_score_function,
    "moe_router_pre_softmax": lambda c: not c.moe_norm_topk_prob,
    "moe_router_topk_scaling_factor": lambda c: (
        c.moe_router_topk_scaling_factor if c.num_experts is not None else None
    ),
}


def check_given_flags(values: dict[str, object]) -> None:
    """Raise when a model flag given on the command line or in a config file (`values`, by
    field name) contradicts `--load-hf`, even one given at its default value."""
    path = values.get("load_hf")
    if not path or not os.path.isdir(path):
        return  # TrainArgs names a missing folder
    config = config_from_hf(path)
    for flag, value_of in _FLAGS.items():
        given = values.get(flag)
        if flag == "kv_channels" and given is None:  # None is hidden / heads
            given = (
                config.hidden_size // config.num_attention_heads
                if config.hidden_size % config.num_attention_heads == 0
                else None
            )
        if flag in values and given != value_of(config):
            raise ValueError(
                f"tpcore: training arguments: --{flag.replace('_', '-')} {values[flag]!r} "
                f"contradicts --load-hf {path}/config.json, which gives {value_of(config)!r}"
            )


def apply_hf_architecture(
    args, defaults: dict[str, object], need: Callable[[bool, str], None]
) -> None:
    """Set `args`' model flags from `args.load_hf` (and its tokenizer), `need`-ing that no
    flag set away from its default (`defaults`) contradicts the folder."""
    path = args.load_hf
    if not os.path.isdir(path):
        need(
            False,
            f"--load-hf {path} is not a folder (a Hugging Face model saved with save_pretrained)",
        )
    try:
        config = config_from_hf(path)
    except (ValueError, OSError) as e:
        need(False, f"--load-hf {path}: {str(e).removeprefix('tpcore: ')}")
    for flag, value_of in _FLAGS.items():
        mine, theirs = getattr(args, flag), value_of(config)
        need(
            mine == defaults[flag] or mine == theirs,
            f"--{flag.replace('_', '-')} {mine!r} contradicts --load-hf {path}/config.json, which "
            f"gives {theirs!r}",
        )
        setattr(args, flag, theirs)
    need(
        args.seq_length <= config.max_position_embeddings,
        f"--seq-length {args.seq_length} exceeds max_position_embeddings "
        f"{config.max_position_embeddings} of --load-hf {path}",
    )
    need(
        config.sliding_window is None or args.seq_length <= config.sliding_window,
        f"--seq-length {args.seq_length} exceeds the sliding_window {config.sliding_window} of "
        f"--load-hf {path} (sliding-window attention is not implemented)",
    )
    if args.tokenizer == "byte":
        need(
            os.path.isfile(os.path.join(path, "tokenizer.json")),
            f"--load-hf {path} has no tokenizer.json: pass the model's tokenizer with --tokenizer",
        )
        args.tokenizer = path


def check_save_hf_paths(args, need: Callable[[bool, str], None]) -> None:
    """`need` that `--save-hf` is none of the run's other folders. Into `--load-hf` the
    export would overwrite the weights training started from, then fail copying the
    tokenizer onto itself: the source model lost. Into --save, --load or --log-dir it would
    mix with the checkpoints and logs; so would a --save-hf above --save or --log-dir, whose
    files the export refuses only once training is over."""
    for flag, folder in (
        ("--load-hf", args.load_hf),
        ("--save", args.save),
        ("--load", args.load),
        ("--log-dir", args.log_dir),
        (
            "--tokenizer",
            None if args.tokenizer == "byte" or os.path.isfile(args.tokenizer) else args.tokenizer,
        ),
    ):
        need(
            not folder or not same_folder(args.save_hf, folder),
            f"--save-hf {args.save_hf} is the {flag} folder {folder}: export into a folder of its "
            "own (a new or empty one)",
        )
    for flag, folder in (("--save", args.save), ("--log-dir", args.log_dir)):
        need(
            not folder or not inside(folder, args.save_hf),
            f"--save-hf {args.save_hf} holds the {flag} folder {folder}: the export would find the "
            "run's files there and refuse the folder after training; export into a folder of its "
            "own (a new or empty one)",
        )


def check_save_hf_folder(args, device: torch.device | str) -> None:
    """Before the first step: rank 0 (the exporting rank) checks that `--save-hf` holds no
    files the export would not replace; every rank raises if not."""
    import torch.distributed as dist

    from ..agreement import all_or_none
    from ..hf.gpt_bridge.export import check_export_folder

    def check() -> None:
        if dist.get_rank() == 0:
            check_export_folder(args.save_hf, None if args.tokenizer == "byte" else args.tokenizer)

    all_or_none(check, f"checking --save-hf {args.save_hf}", device, error_type=ValueError)


def hf_model_config(args) -> GPTConfig:
    """The GPTConfig of `--load-hf` with the run-time flags applied (an MoE model's
    balancing, capacity and dispatch options included)."""
    return config_from_hf(
        args.load_hf,
        dropout=args.dropout,
        attention_dropout=args.attention_dropout,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        fused_lm_head_loss=args.fused_lm_head_loss,
        cp_comm_type=args.cp_comm_type,
        **_moe_run_options(args),
    )


def _moe_run_options(args) -> dict:
    """An MoE folder's run-time options from the flags; the balancing coefficient from the
    folder (`router_aux_loss_coef`, converted) unless --moe-aux-loss-coeff sets one."""
    if args.num_experts is None:
        return {}
    options = args.moe_run_options()
    if options["moe_aux_loss_coeff"] == 0.0:
        del options["moe_aux_loss_coeff"]
    return options


def check_tokenizer_fits(tokenizer, config: GPTConfig, path: str) -> None:
    """The tokenizer's ids must index the folder's embedding (which may be padded past them)."""
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"tpcore: the tokenizer has {tokenizer.vocab_size} ids but --load-hf {path} embeds "
            f"only {config.vocab_size}: not this model's tokenizer"
        )


def load_initial_hf_weights(chunks: Sequence, path: str, device) -> None:
    """Fill this rank's chunks from the folder; every rank raises if any rank failed."""
    from ..agreement import all_or_none
    from ..hf.gpt_bridge import load_hf_weights

    all_or_none(
        lambda: load_hf_weights(chunks, path),
        f"loading --load-hf {path}",
        device,
        error_type=ValueError,
    )


def save_hf(chunks: Sequence, args, tokenizer, *, pp_group, dp_group) -> str:
    """Export the trained model to `args.save_hf` (a collective over every rank)."""
    from ..hf.gpt_bridge import export_hf

    return export_hf(
        chunks,
        args.save_hf,
        hf_config=read_hf_config(args.load_hf) if args.load_hf else None,
        tokenizer=None if args.tokenizer == "byte" else args.tokenizer,
        eos_token_id=tokenizer.eod,
        pp_group=pp_group,
        dp_group=dp_group,
    )
