"""Pipeline parallelism: point-to-point messages between stages, the GPipe, 1F1B and
interleaved 1F1B schedules, and GPTModel split into stages (`tpcore.pipeline_parallel`)."""

from . import p2p
from .gpt_stages import (
    activation_shape,
    build_gpt_stages,
    duplicate_parameter_names,
    finalize_model_grads,
    gpt_forward_step,
    head_only_tied_weights,
    lookup_and_head_weights,
    lookup_only_weights,
    split_layers,
    sync_tied_embeddings,
    tied_embedding_copies,
)
from .schedule_table import (
    SCHEDULES,
    Action,
    ScheduleTable,
    check_schedule,
    rank_actions,
    schedule_table,
)
from .schedules import PipelineStats, forward_backward

__all__ = [
    "p2p",
    "SCHEDULES",
    "Action",
    "ScheduleTable",
    "check_schedule",
    "rank_actions",
    "schedule_table",
    "forward_backward",
    "PipelineStats",
    "split_layers",
    "build_gpt_stages",
    "activation_shape",
    "gpt_forward_step",
    "head_only_tied_weights",
    "lookup_and_head_weights",
    "lookup_only_weights",
    "tied_embedding_copies",
    "duplicate_parameter_names",
    "sync_tied_embeddings",
    "finalize_model_grads",
]
