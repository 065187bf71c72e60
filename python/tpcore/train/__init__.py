"""GPT pretraining: arguments, the training loop, checkpoints, metrics (`tpcore.train`)."""

from .arguments import TrainArgs, load_config_file, parse_args
from .checkpoint import CheckpointError, find_checkpoint, load_checkpoint, load_dense_state_dict, save_checkpoint
from .convert import export_safetensors, load_dense_gpt
from .logger import MetricsLogger, plot_loss_curve, read_metrics
from .optimizer import LossScaler, ParallelAdamW, average_data_parallel_grads, grad_norm
from .sampling import gather_model_on_first_stage
from .schedule import learning_rate
from .trainer import init_distributed, pretrain

__all__ = [
    "TrainArgs", "parse_args", "load_config_file", "pretrain", "init_distributed",
    "save_checkpoint", "load_checkpoint", "find_checkpoint", "load_dense_state_dict", "CheckpointError",
    "export_safetensors", "load_dense_gpt", "gather_model_on_first_stage",
    "MetricsLogger", "read_metrics", "plot_loss_curve",
    "ParallelAdamW", "LossScaler", "average_data_parallel_grads", "grad_norm", "learning_rate", "main",
]


def main(argv: list[str] | None = None) -> int:
    """`python -m tpcore.train ...` / examples/pretrain_gpt.py: parse flags, train, clean up."""
    from ..parallel_state import shutdown

    args = parse_args(argv)
    ok = False
    try:
        pretrain(args)
        ok = True
    finally:
        shutdown(barrier=ok)
    return 0
