"""The trainer's mixture-of-experts flags (Megatron-Core's `--num-experts`, `--moe-*`) as
GPTConfig fields. Without `--num-experts` every other `--moe-*` flag is refused; with
`--load-hf` the folder gives the architecture and the run-time options stay with the flags
(`hf_flags`)."""

from __future__ import annotations

import ast
import dataclasses
from typing import Callable

__all__ = ["check_moe_flags", "moe_config_fields", "moe_run_fields", "parse_moe_layer_freq"]


def check_moe_flags(args, need: Callable[[bool, str], None]) -> None:
    """`need` that the expert-parallel size fits the experts."""
    need(
        args.num_experts is not None or args.expert_model_parallel_size == 1,
        f"--expert-model-parallel-size {args.expert_model_parallel_size} needs --num-experts",
    )
    if args.num_experts is not None:
        need(
            args.num_experts % args.expert_model_parallel_size == 0,
            f"--num-experts {args.num_experts} is not divisible by "
            f"--expert-model-parallel-size {args.expert_model_parallel_size}",
        )


def moe_config_fields(args) -> dict:
    """The GPTConfig fields of `args`' MoE flags (none without --num-experts)."""
    if args.num_experts is None:
        given = [
            f"--{f.name.replace('_', '-')}"
            for f in dataclasses.fields(args)
            if f.name.startswith("moe_") and getattr(args, f.name) != f.default
        ]
        if given:
            raise ValueError(f"tpcore: {', '.join(given)} need(s) --num-experts")
        return {}
    return dict(
        num_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_layer_freq=parse_moe_layer_freq(args.moe_layer_freq),
        moe_router_score_function=args.moe_router_score_function,
        moe_norm_topk_prob=not args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor or 1.0,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        **moe_run_fields(args),
    )


def moe_run_fields(args) -> dict:
    """The MoE flags that are run-time choices, not architecture."""
    return dict(
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff or 0.0,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=args.moe_grouped_gemm,
    )


def parse_moe_layer_freq(text: str | int) -> int | list[int]:
    """--moe-layer-freq: "N" (every N-th layer), "0,1,1" or "[0, 1, 1]", or Megatron's
    list expression "([0]*1+[1]*3)*2" (lists of 0 / 1, +, * by an int; nothing else runs)."""
    text = str(text).strip()
    if text.isdigit():
        return int(text)

    def value(node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            times = left if type(left) is int else right
            if isinstance(node.op, ast.Mult) and type(times) is int and times > 100_000:
                raise ValueError(node)  # a per-layer list is never this long
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(node)

    try:
        result = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        result = None
    if type(result) is int:
        return result
    if not isinstance(result, list) or any(type(v) is not int for v in result):
        raise ValueError(
            f"tpcore: --moe-layer-freq must be an int, a 0/1 list such as 0,1,1 or Megatron's "
            f'"([0]*1+[1]*3)", got {text!r}'
        )
    return result
