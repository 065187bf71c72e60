"""GPT pretraining loop: tensor + context + pipeline + data parallel, micro-batches, eval,
checkpoints."""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import signal
import socket
import time

import torch
import torch.distributed as dist

from .. import parallel_state, shm
from .._validation import check_cuda_device
from ..agreement import all_or_none
from ..checkpoint.errors import CheckpointError
from ..checkpoint.index import read_latest, read_metadata, require_checkpoint
from ..checkpoint.integrity import random_id
from ..checkpoint.load import find_checkpoint, load_checkpoint, save_checkpoint
from ..comm_threads import prioritize_communication_threads
from ..data import load_tokenizer
from ..hf.gpt_bridge.config import read_hf_config
from ..models import ReferenceGPT
from ..models.generate import generate
from ..optimizer.parallel_adamw import LossScaler
from ..optimizer.setup import make_optimizer
from ..pipeline_parallel import (
    activation_shape,
    build_gpt_stages,
    check_schedule,
    finalize_model_grads,
    forward_backward,
    gpt_forward_step,
    sync_tied_embeddings,
)
from ..pipeline_parallel.gather import gather_model_on_first_stage
from ..tensor_parallel.random import model_parallel_manual_seed
from ..tensor_parallel.shard_spec import shard_spec
from . import heartbeat
from .arguments import TrainArgs
from .attempt_store import attempt_store
from .errors import TrainingError
from .guards import SkippedStepGuard, check_output_folder, phase
from .hf_flags import check_save_hf_folder, check_tokenizer_fits, load_initial_hf_weights, save_hf
from .logger import MetricsLogger, StepTimer, plot_loss_curve
from .lora_setup import add_adapters, checkpoint_role, finish_lora, load_lora_base, lora_settings
from .lr_schedule import learning_rate
from .moe_metrics import (
    MOE_COLUMNS,
    discard_moe_totals,
    moe_step_metrics,
    moe_step_totals,
    set_aux_loss_scale,
    update_expert_biases,
)
from .preemption import StepAgreement
from .same_arguments import check_same_arguments
from .training_data import Batches, training_batches

__all__ = ["pretrain", "init_distributed", "precision"]


def init_distributed(device: str, timeout_s: float = 600.0) -> None:
    """Join the torchrun job (gloo on CPU, NCCL on CUDA), or form a 1-rank job when not
    launched by torchrun. Collectives time out after `timeout_s` instead of hanging."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        check_cuda_device("init_distributed", local_rank)
        torch.cuda.set_device(local_rank)
    backend, timeout = "nccl" if device == "cuda" else "gloo", datetime.timedelta(seconds=timeout_s)
    met = attempt_store(timeout)  # torchrun: a store of this attempt's own (see attempt_store.py)
    if met is not None:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        dist.init_process_group(backend, store=met[0], rank=rank, world_size=world, timeout=timeout)
        heartbeat.start(met[1], rank, world)  # names silent ranks when a collective times out
        return
    dist.init_process_group(backend, timeout=timeout)


def _resume_point(args: TrainArgs) -> str | None:
    """The checkpoint `--load` names, or None to start from scratch. Raises (every rank
    alike, before any collective) when `--load` is a folder that does not exist or holds no
    checkpoint, unless it is also the `--save` folder: that is the auto-resume idiom, whose
    first run has nothing to load; anywhere else a missing folder is a typo."""
    if not args.load:
        return None
    auto_resume = args.save is not None and os.path.realpath(args.load) == os.path.realpath(
        args.save
    )
    if not os.path.exists(args.load):
        if auto_resume:
            return None
        raise FileNotFoundError(
            f"tpcore: --load {args.load} does not exist (a typo?); to resume automatically "
            "whenever a checkpoint is there, pass the same folder to --save"
        )
    found = find_checkpoint(args.load)  # a damaged 'latest' or only incomplete iter_N folders raise
    if found is None and not auto_resume:
        raise CheckpointError(
            f"tpcore: --load {args.load} holds no checkpoint (no metadata.json, no 'latest' file, "
            "no iter_N folder)"
        )
    return found


def precision(args: TrainArgs) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype or None): --bf16 / --fp16 make the model itself low
    precision (fp32 masters in the optimizer); --autocast keeps fp32 weights and runs the
    forward under torch.autocast."""
    params = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return params, {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.autocast]


def _transport(group) -> str:
    """What carries `group`'s CPU collectives: tpcore's shared memory (ranks of one host),
    or the group's backend (gloo across hosts, NCCL on GPUs)."""
    if dist.get_world_size(group) == 1:
        return "one rank"
    return "shared memory" if shm.shm_backend_of(group) is not None else dist.get_backend(group)


def _dp_mean(value: torch.Tensor, dp_group, device: str) -> float:
    # On the run's device: a NCCL group cannot reduce a CPU tensor.
    value = value.to(device)
    dist.all_reduce(value, group=dp_group)
    return float(value.item()) / dist.get_world_size(dp_group)


class _Training:
    """One run, in named phases: `__init__` sets everything up (groups, data, model,
    optimizer, resume), `step` trains one global batch, `evaluate`, `save`, `finish`."""

    def __init__(self, args: TrainArgs) -> None:
        self.args = args
        device = (
            ("cuda" if torch.cuda.is_available() else "cpu")
            if args.device == "auto"
            else args.device
        )
        self.device = device
        timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
        init_distributed(device, timeout.total_seconds())
        # The first collective: ranks given other flags (a per-rank environment) would build
        # other groups, or train replicated weights apart, before anything else could tell.
        check_same_arguments(args)
        # After the rendezvous, so that every rank gets to raise before torchrun stops the job.
        self.resume_from = _resume_point(args)
        # A checkpoint without adapters under --lora-rank is the base they fine-tune; every
        # rank reads the same metadata, so a mismatch raises on all of them alike.
        self.finetune_from, self.lora_base = None, None
        if self.resume_from is not None:
            meta = read_metadata(require_checkpoint(self.resume_from))
            if checkpoint_role(meta, args, self.resume_from) == "base":
                self.finetune_from, self.resume_from = self.resume_from, None
            elif meta.get("lora"):
                self.lora_base = meta["lora"]["base"]
        pp, self.chunks_per_rank, self.schedule = (
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size or 1,
            args.schedule,
        )
        if not parallel_state.is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_parallel_size=args.tensor_parallel_size,
                pipeline_parallel_size=pp,
                expert_model_parallel_size=args.expert_model_parallel_size,
                context_parallel_size=args.context_parallel_size,
                timeout=timeout,
            )
        self.tp_group, self.dp_group = (
            parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_data_parallel_group(),
        )
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        # Weights are replicated over CP: gradients are summed over DP x CP (CP ranks hold
        # shares of the same sequences) and divided by DP.
        self.grad_group = parallel_state.get_data_context_parallel_group()
        cp = (parallel_state.get_context_parallel_rank(), args.context_parallel_size)
        dp, dp_rank, self.rank0 = (
            dist.get_world_size(self.dp_group),
            dist.get_rank(self.dp_group),
            dist.get_rank() == 0,
        )
        self.global_batch = global_batch = args.global_batch_size or args.micro_batch_size * dp
        if global_batch % (args.micro_batch_size * dp):
            raise ValueError(
                f"tpcore: --global-batch-size {global_batch} is not divisible by "
                f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}"
            )
        check_schedule(
            self.schedule, pp, global_batch // (args.micro_batch_size * dp), self.chunks_per_rank
        )  # the micro-batch count fits
        if args.data_path is None:
            raise ValueError(
                "tpcore: --data-path is required (the PREFIX of PREFIX.bin/PREFIX.idx made by "
                "tpcore-preprocess)"
            )

        self.tokenizer = load_tokenizer(args.tokenizer)
        config = self.config = args.model_config(self.tokenizer.vocab_size)
        if args.load_hf:
            check_tokenizer_fits(self.tokenizer, config, args.load_hf)
        config.check_tp(dist.get_world_size(self.tp_group))
        config.check_cp(args.context_parallel_size, dist.get_world_size(self.tp_group))
        self.train_batches, self.valid_batches = training_batches(
            args, self.tokenizer.vocab_size, global_batch, (dp_rank, dp), cp, device
        )

        self.dtype, self.autocast_dtype = precision(args)
        if args.save_hf:  # another model's files there would be left beside the export
            check_save_hf_folder(args, device)
        for flag, folder in (
            ("--save", args.save),
            ("--log-dir", args.log_dir),
            ("--save-hf", args.save_hf),
            ("--save-peft", args.save_peft),
        ):
            # a read-only folder or a file in the way fails now, on every rank, not at the
            # first save
            if folder:
                check_output_folder(folder, flag, device)
        self.run_id = random_id(
            device
        )  # recorded in every checkpoint of this run and in each of its shards
        torch.manual_seed(
            args.seed
        )  # one seed for the model: each rank draws only its shards, TP- and PP-size invariant
        self.chunks = build_gpt_stages(
            config,
            num_model_chunks=self.chunks_per_rank,
            layers_per_stage=args.stage_layers(),
            tp_group=self.tp_group,
            pp_group=self.pp_group,
            dtype=self.dtype,
            device=device,
            _init=self.resume_from is None and not args.load_hf,
        )
        if args.load_hf and self.resume_from is None:  # before the optimizer takes its fp32 copies
            load_initial_hf_weights(self.chunks, args.load_hf, device)
        self._take_up_lora_base()
        sync_tied_embeddings(self.chunks)
        model_parallel_manual_seed(args.seed, self.tp_group)
        scaler = (
            LossScaler(args.initial_loss_scale, args.loss_scale_window)
            if torch.float16 in (self.dtype, self.autocast_dtype)
            else None
        )
        self.optimizer, self.grads = make_optimizer(
            self.chunks,
            args.data_parallel_options(),
            tp_group=self.tp_group,
            dp_group=self.grad_group,
            pp_group=self.pp_group,
            grad_divisor=dp,
            lr=args.lr,
            weight_decay=args.weight_decay,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            loss_scaler=scaler,
        )
        self.realtime_threads = 0
        # after every group (and its gloo threads) exists; every rank learns if one failed
        if args.realtime_comm_threads:
            self.realtime_threads = len(
                all_or_none(
                    prioritize_communication_threads,
                    "giving gloo's threads real-time priority (--realtime-comm-threads)",
                    device,
                    error_type=TrainingError,
                )
            )
        self.start = 0
        if self.resume_from:
            self._resume()
        self.log_dir = args.log_dir or args.save
        # Rank 0 alone makes the log folder and files: every rank learns if that failed.
        self.logger = all_or_none(
            lambda: MetricsLogger(
                active=self.rank0,
                log_dir=self.log_dir,
                total_iters=args.train_iters,
                start_iter=self.start,
                log_interval=args.log_interval,
                progress=args.progress,
                extra_columns=MOE_COLUMNS if config.num_experts is not None else (),
            ),
            f"opening the metrics files in {self.log_dir}",
            device,
            error_type=TrainingError,
        )
        self.shape = activation_shape(
            config,
            args.micro_batch_size,
            args.seq_length // args.context_parallel_size,
            dist.get_world_size(self.tp_group),
        )
        self._banner(dp)

    def _take_up_lora_base(self) -> None:
        """The base weights under the adapters (a checkpoint's, or --load-hf's), then the
        adapters, before the optimizer sees the parameters."""
        args = self.args
        if self.finetune_from is not None:
            with phase(
                f"loading the base weights of checkpoint {self.finetune_from}",
                args.distributed_timeout_minutes,
            ):
                self.lora_base = load_lora_base(
                    self.finetune_from, self.chunks, self.tp_group, self.pp_group, args
                )
        elif args.load_hf and self.resume_from is None:
            self.lora_base = {"hf": os.path.abspath(args.load_hf)}
        if args.lora_rank is not None:  # pipeline stages differ: every rank learns of a failure
            all_or_none(
                lambda: add_adapters(self.chunks, args),
                "adding the LoRA adapters",
                self.device,
                error_type=TrainingError,
            )

    def _resume(self) -> None:
        args = self.args
        with phase(f"loading checkpoint {self.resume_from}", args.distributed_timeout_minutes):
            meta = load_checkpoint(
                self.resume_from,
                self.chunks,
                self.optimizer,
                tp_group=self.tp_group,
                pp_group=self.pp_group,
                verify=args.verify_checkpoint,
            )
        self.start = meta["iteration"]
        # The data position is step x global batch: another global batch would silently skip
        # or repeat samples. Every rank read the same metadata, so all raise alike.
        if (
            meta.get("consumed_samples", self.start * self.global_batch)
            != self.start * self.global_batch
        ):
            raise ValueError(
                f"tpcore: the checkpoint consumed {meta['consumed_samples']} samples in "
                f"{self.start} steps (global batch "
                f"{meta['consumed_samples'] // max(self.start, 1)}); resume with that "
                f"--global-batch-size, not {self.global_batch}"
            )

    def _banner(self, dp: int) -> None:
        args, pp = self.args, self.args.pipeline_model_parallel_size
        no_latest = (
            self.resume_from is not None
            and os.path.realpath(self.resume_from) != os.path.realpath(args.load)
            and read_latest(args.load) is None
        )
        params = sum(p.numel() for p in ReferenceGPT(self.config, device="meta").parameters())
        options = args.data_parallel_options()
        dp_text = "".join(
            f" +{flag}"
            for flag, on in (
                ("distributed-optimizer", options.use_distributed_optimizer),
                ("overlap-grad-reduce", options.overlap_grad_reduce),
                ("overlap-param-gather", options.overlap_param_gather),
            )
            if on
        )
        # what it reached: gloo threads exist only where a group runs on gloo
        if args.realtime_comm_threads:
            dp_text += (
                f" +realtime-comm-threads ({self.realtime_threads} gloo threads; DP on "
                f"{dist.get_backend(self.dp_group)})"
            )
        self.logger.print(
            f"tpcore: GPT {params / 1e6:.2f}M parameters | world {dist.get_world_size()} = TP "
            f"{dist.get_world_size(self.tp_group)}"
            + (
                f" x CP {args.context_parallel_size} ({args.cp_comm_type})"
                if args.context_parallel_size > 1
                else ""
            )
            + f" x DP {dp}{dp_text}"
            + (
                f" x PP {pp} ({self.schedule}, {self.chunks_per_rank} chunk(s) per rank) | "
                if pp > 1
                else " | "
            )
            + f"TP on {_transport(self.tp_group)}, DP on {_transport(self.grad_group)} | "
            + (
                f"MoE {self.config.num_experts} experts, top-{self.config.moe_router_topk}, EP "
                f"{args.expert_model_parallel_size} ({self.config.moe_token_dispatcher_type}) | "
                if self.config.num_experts is not None
                else ""
            )
            + (
                f"{self.device} "
                f"{str(self.dtype).removeprefix('torch.')}"
                f"{' autocast ' + args.autocast if self.autocast_dtype else ''} | "
            )
            + (
                f"global batch {self.global_batch} = micro {args.micro_batch_size} x DP {dp} x "
                f"accumulation {self.train_batches.accumulation} | "
            )
            + (
                f"LoRA rank {args.lora_rank} on {args.lora_target_modules}: "
                f"{self._trainable() / 1e6:.3f}M trainable parameters | "
                if args.lora_rank is not None
                else ""
            )
            + (
                f"resumed from {self.resume_from} at iteration {self.start}"
                if self.resume_from
                else f"fine-tuning the weights of checkpoint {self.finetune_from}"
                if self.finetune_from
                else f"from the Hugging Face model {args.load_hf}"
                if args.load_hf
                else "from scratch"
            )
            + (
                f" (no 'latest' file in --load {args.load}: its newest complete checkpoint)"
                if no_latest
                else ""
            )
        )

    def _trainable(self) -> int:
        """Trainable parameters of the whole model: whole tensors of this stage's, summed over
        the pipeline stages (a collective over the pipeline group)."""
        mine = sum(
            math.prod(shard_spec(p).global_shape)
            for chunk in self.chunks
            for p in chunk.parameters()
            if p.requires_grad
        )
        total = torch.tensor([mine], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.pp_group)
        return int(total.item())

    def run_pipeline(self, batches: Batches, step: int, forward_only: bool) -> torch.Tensor:
        """The mean loss of one global batch (this DP rank's part), on every rank; with the
        backward unless `forward_only` (gradients accumulate into the buffers / .grad)."""
        micro_batches = [batches(step, micro) for micro in range(batches.accumulation)]
        if self.grads is not None and not forward_only:
            self.grads.start_step(batches.accumulation)
        if self.config.num_experts is not None:  # the MoE losses' share of each micro-batch
            set_aux_loss_scale(self.chunks, self.optimizer.loss_scale / batches.accumulation)
        return forward_backward(
            gpt_forward_step(
                self.chunks,
                micro_batches,
                tensor_shape=self.shape,
                autocast_dtype=self.autocast_dtype,
            ),
            num_micro_batches=batches.accumulation,
            tensor_shape=self.shape,
            dtype=self.dtype,
            device=self.device,
            schedule=self.schedule,
            num_model_chunks=self.chunks_per_rank,
            group=self.pp_group,
            forward_only=forward_only,
            loss_scale=self.optimizer.loss_scale,
        ).cpu()

    def step(self, iteration: int, skips: SkippedStepGuard) -> tuple[dict, bool, float]:
        """Train step `iteration` (0-based): (metrics, skipped, whether a skip is explained by
        the loss scale)."""
        args = self.args
        with StepTimer(self.device == "cuda") as timer:
            step_loss = self.run_pipeline(self.train_batches, iteration, forward_only=False)
            if self.grads is not None:
                # DP (bucket by bucket), sequence-parallel and tied-embedding sums
                self.grads.finish_grad_sync()
            else:
                finalize_model_grads(
                    self.chunks, tp_group=self.tp_group
                )  # sequence-parallel and tied-embedding gradients
            lr = learning_rate(
                iteration,
                lr=args.lr,
                min_lr=args.min_lr,
                warmup_iters=args.lr_warmup_iters,
                decay_iters=args.lr_decay_iters or args.train_iters,
                style=args.lr_decay_style,
            )
            explained = skips.scale_can_drop()
            grad_norm, skipped = self.optimizer.step(lr, args.clip_grad)
            loss = _dp_mean(step_loss, self.dp_group, self.device)
        metrics = dict(
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            loss_scale=self.optimizer.loss_scale,
            skipped=float(skipped),
            tokens_per_s=self.global_batch * args.seq_length / timer.seconds,
            step_ms=1000 * timer.seconds,
        )
        if self.config.num_experts is not None:
            losses, loads = moe_step_totals(self.chunks, self.device)
            update_expert_biases(self.chunks, loads)
            dp = dist.get_world_size(self.dp_group)
            metrics.update(moe_step_metrics(losses, loads, self.train_batches.accumulation, dp))
        return metrics, skipped, explained

    def evaluate(self) -> float:
        for chunk in self.chunks:
            chunk.eval()
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for step in range(self.args.eval_iters):
                total += self.run_pipeline(self.valid_batches, step, forward_only=True)
        for chunk in self.chunks:
            chunk.train()
        if self.config.num_experts is not None:
            discard_moe_totals(self.chunks)
        return _dp_mean(total / self.args.eval_iters, self.dp_group, self.device)

    def save(self, iteration: int) -> None:
        args = self.args
        start = time.perf_counter()
        path = save_checkpoint(
            args.save,
            iteration,
            self.chunks,
            self.optimizer,
            consumed_samples=iteration * self.global_batch,
            tp_group=self.tp_group,
            dp_group=self.grad_group,
            pp_group=self.pp_group,
            run_id=self.run_id,
            ckpt_format=args.ckpt_format,
            extra={
                "args": dataclasses.asdict(args),
                "tokenizer": args.tokenizer
                if args.tokenizer == "byte"
                else os.path.abspath(args.tokenizer),
                "hf_config": read_hf_config(args.load_hf) if args.load_hf else None,
                "lora": lora_settings(args, self.lora_base),
            },
        )
        self.logger.print(f"tpcore: saved checkpoint {path} in {time.perf_counter() - start:.2f} s")

    def finish(self, preempted: bool = False) -> None:
        """Close the logs, plot the loss curve; unless `preempted` (the nodes are being
        taken back), export and sample when asked."""
        args = self.args
        self.logger.close()
        if (
            self.rank0
            and self.log_dir
            and self.logger.csv_path
            and os.path.isfile(self.logger.csv_path)
        ):
            png = os.path.join(self.log_dir, "loss_curve.png")
            self.logger.print(
                f"tpcore: loss curve {png}"
                if plot_loss_curve(self.logger.csv_path, png)
                else "tpcore: no loss-curve PNG (matplotlib is not installed)"
            )
        self.optimizer.finish_param_sync()  # the last step's parameter gathers
        if preempted:
            return
        if args.lora_rank is not None:  # adapters for PEFT, then merged for what follows
            finish_lora(self.chunks, args, self.pp_group, self.grad_group, self.logger.print)
        if args.save_hf:
            with phase(
                f"exporting the model to --save-hf {args.save_hf}", args.distributed_timeout_minutes
            ):
                folder = save_hf(
                    self.chunks,
                    args,
                    self.tokenizer,
                    pp_group=self.pp_group,
                    dp_group=self.grad_group,
                )
                self.logger.print(f"tpcore: exported the Hugging Face model {folder}")
        # With pipeline parallelism the first stage gathers the whole model (at its TP rank) and
        # samples alone.
        model = (
            gather_model_on_first_stage(self.chunks, pp_group=self.pp_group)
            if args.sample_tokens
            else None
        )
        if model is not None:
            prompt = torch.tensor(
                [self.tokenizer.encode(args.sample_prompt)], dtype=torch.long, device=self.device
            )
            out = generate(
                model, prompt, args.sample_tokens, top_k=8, seed=args.seed, eod=self.tokenizer.eod
            )
            self.logger.print(
                "tpcore: sample (top-k 8):\n" + self.tokenizer.decode(out[0].tolist())
            )


def pretrain(args: TrainArgs) -> dict:
    """Train a GPT as `args` say (call on every rank of a torchrun job). Returns the
    final metrics {"iteration", "loss", "valid_loss", "preempted"} (identical on every
    rank; "preempted": stopped by a signal under --exit-signal-handler)."""
    try:
        return _pretrain(args)
    finally:
        # Before this rank can reach the end-of-run barrier: once past it rank 0 exits, taking
        # down the store the heartbeats go to, and a beat still running would fail there
        # (torch logs each failed store call with a C++ stack trace).
        heartbeat.stop()


def _pretrain(args: TrainArgs) -> dict:
    # Before the set-up: a signal while it runs (loading a checkpoint) stops at step one.
    agreement = StepAgreement(
        exit_signal_handler=args.exit_signal_handler,
        save_interval_minutes=args.save_interval_minutes,
    )
    try:
        run = _Training(args)
    except BaseException:
        agreement.close()
        raise
    agreement.device = run.device
    for chunk in run.chunks:
        chunk.train()
    loss = valid_loss = float("nan")
    iteration = run.start
    minutes = args.distributed_timeout_minutes
    skips = SkippedStepGuard(args.max_skipped_steps, run.optimizer.scaler)
    preempted = None
    try:
        while iteration < args.train_iters:
            with phase(
                f"training step {iteration + 1} (forward, backward, gradient reductions, "
                "optimizer)",
                minutes,
            ):
                metrics, skipped, explained = run.step(iteration, skips)
            loss = metrics["loss"]
            iteration += 1
            stop = iteration == args.train_iters or (
                args.exit_interval is not None and iteration - run.start >= args.exit_interval
            )
            with phase(f"agreeing on a stop signal or a save after step {iteration}", minutes):
                preempted, save_due = agreement.decide()
            if run.valid_batches and (
                iteration % args.eval_interval == 0 or (stop and preempted is None)
            ):
                with phase(f"evaluation after step {iteration}", minutes):
                    metrics["valid_loss"] = valid_loss = run.evaluate()
                run.logger.print(f"tpcore: iteration {iteration}: validation loss {valid_loss:.4f}")
            run.logger.record(iteration, **metrics)
            skips.update(
                iteration, skipped, explained, loss
            )  # raises on every rank alike, before any save of this step
            interval = args.save_interval and iteration % args.save_interval == 0
            if args.save and (interval or stop or save_due or preempted is not None):
                with phase(f"saving the checkpoint of step {iteration}", minutes):
                    run.save(iteration)
                agreement.saved()
                if preempted is None:  # a signal during the save: this checkpoint is fresh
                    with phase(f"agreeing on a stop signal after step {iteration}", minutes):
                        preempted, _ = agreement.decide()
            if preempted is not None:
                run.logger.print(
                    f"tpcore: {signal.Signals(preempted).name} received: stopped after step "
                    f"{iteration}"
                    + (
                        f"; its checkpoint is in {args.save}, resume with --load {args.save}"
                        if args.save
                        else "; nothing saved (no --save)"
                    )
                )
                break
            if stop:
                break
    finally:
        agreement.close()
    run.finish(preempted=preempted is not None)
    return {
        "iteration": iteration,
        "loss": loss,
        "valid_loss": valid_loss,
        "preempted": preempted is not None,
    }
