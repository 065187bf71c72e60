"""GPT pretraining: arguments, the training loop, checkpoints, metrics (`tpcore.train`)."""

from ..checkpoint.load import (
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    load_dense_state_dict,
    require_checkpoint,
    save_checkpoint,
)
from ..distributed.data_parallel import DataParallelGrads
from ..optimizer.distributed_adamw import DistributedAdamW
from ..optimizer.parallel_adamw import (
    LossScaler,
    ParallelAdamW,
    average_data_parallel_grads,
    grad_norm,
)
from ..optimizer.setup import DataParallelOptions, make_optimizer
from ..pipeline_parallel.gather import gather_model_on_first_stage
from .arguments import TrainArgs, load_config_file, parse_args
from .convert import export_safetensors, load_dense_gpt
from .errors import TrainingError
from .logger import MetricsLogger, plot_loss_curve, read_metrics
from .lr_schedule import learning_rate
from .startup import report_startup_error
from .trainer import init_distributed, pretrain

__all__ = [
    "TrainArgs",
    "parse_args",
    "load_config_file",
    "pretrain",
    "init_distributed",
    "save_checkpoint",
    "load_checkpoint",
    "find_checkpoint",
    "require_checkpoint",
    "load_dense_state_dict",
    "CheckpointError",
    "TrainingError",
    "export_safetensors",
    "load_dense_gpt",
    "gather_model_on_first_stage",
    "MetricsLogger",
    "read_metrics",
    "plot_loss_curve",
    "ParallelAdamW",
    "DistributedAdamW",
    "DataParallelGrads",
    "DataParallelOptions",
    "make_optimizer",
    "LossScaler",
    "average_data_parallel_grads",
    "grad_norm",
    "learning_rate",
    "main",
]


def main(argv: list[str] | None = None) -> int:
    """`python -m tpcore.train ...` / examples/pretrain_gpt.py: parse flags, train, clean up."""
    from ..parallel_state import shutdown

    try:
        args = parse_args(argv)
    except (ValueError, OSError) as e:
        report_startup_error(e)  # every rank prints its error before torchrun stops them
        raise
    ok = False
    try:
        pretrain(args)
        ok = True
    except (ValueError, OSError, CheckpointError) as e:
        # Bad input is found on every rank alike: let each print it before torchrun stops them.
        report_startup_error(e)
        raise
    finally:
        shutdown(barrier=ok)
    return 0
