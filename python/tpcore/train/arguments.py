"""Training arguments: Megatron-style flags, a YAML/JSON config file, validation.

Precedence: the defaults below < values in `--config FILE` < flags on the command line.
Flag names are the field names with dashes (`micro_batch_size` -> `--micro-batch-size`);
config files may use either spelling.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field

from ..checkpoint.dcp_slices import has_checkpointable
from ..hf.gpt_bridge.config import config_to_hf
from ..models import GPTConfig
from ..optimizer.setup import DataParallelOptions
from ..pipeline_parallel.gpt_stages import split_layers
from ..pipeline_parallel.schedule_table import SCHEDULES
from .config_file import read_config_file
from .hf_flags import (
    apply_hf_architecture,
    check_given_flags,
    check_save_hf_paths,
    hf_model_config,
)
from .moe_flags import check_moe_flags, moe_config_fields, moe_run_fields

__all__ = ["TrainArgs", "parse_args", "load_config_file"]


def _arg(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainArgs:
    """Everything `tpcore.train.pretrain` needs; one field per command-line flag."""

    # Model
    num_layers: int = _arg(4, "transformer blocks")
    hidden_size: int = _arg(256, "model width")
    num_attention_heads: int = _arg(8, "query heads (divisible by the TP size)")
    num_kv_heads: int | None = _arg(
        None, "key/value heads for GQA (default: as many as query heads)"
    )
    ffn_hidden_size: int | None = _arg(None, "MLP width (default 4 * hidden)")
    kv_channels: int | None = _arg(None, "width of each attention head (default hidden / heads)")
    qk_layernorm: bool = _arg(False, "normalise each query and key head (Qwen3's q / k norms)")
    qk_norm_scope: str = _arg(
        "head",
        "with --qk-layernorm: normalise each head, or the whole q / k projection (OLMoE's)",
        ("head", "projection"),
    )
    seq_length: int = _arg(128, "tokens per sample")
    max_position_embeddings: int | None = _arg(
        None, "longest sequence the model accepts (default seq-length)"
    )
    norm: str = _arg(
        "layernorm",
        "normalisation (gemma_rmsnorm: x / rms(x) * (1 + weight))",
        ("layernorm", "rmsnorm", "gemma_rmsnorm"),
    )
    activation: str = _arg(
        "gelu",
        "MLP activation (gelu: tanh approximation)",
        ("gelu", "gelu_exact", "swiglu", "geglu"),
    )
    embedding_scale: float | None = _arg(
        None, "multiply the word embeddings by this (Gemma: sqrt(hidden-size))"
    )
    position_embedding: str = _arg("learned", "positions", ("learned", "rotary"))
    dropout: float = _arg(0.0, "hidden dropout")
    attention_dropout: float = _arg(0.0, "attention-probability dropout")
    untie_embeddings: bool = _arg(False, "separate LM head instead of the tied word embedding")
    disable_bias: bool = _arg(False, "no biases in linear layers and norms")
    fused_lm_head_loss: bool = _arg(
        False, "LM head + loss chunk by chunk (logits never materialised)"
    )
    load_hf: str | None = _arg(
        None,
        "start from a Hugging Face model folder: its architecture (a contradicting model flag "
        "raises), weights and tokenizer.json",
    )
    save_hf: str | None = _arg(
        None,
        "at the end, export the model as a Hugging Face folder here (a new or empty folder, or an "
        "earlier export's; not --load-hf's)",
    )
    # LoRA fine-tuning (docs/lora.md)
    lora_rank: int | None = _arg(
        None,
        "train rank-r LoRA adapters on --lora-target-modules, every other weight frozen "
        "(default: no adapters, every weight trains)",
    )
    lora_alpha: float | None = _arg(None, "LoRA scale = alpha / rank (default: alpha = rank)")
    lora_dropout: float = _arg(0.0, "dropout on the LoRA adapters' input")
    lora_target_modules: str = _arg(
        "qkv,proj,fc1,fc2", "the layers that get LoRA adapters, comma-separated: qkv proj fc1 fc2"
    )
    lora_use_rslora: bool = _arg(False, "rsLoRA's scale alpha / sqrt(rank)")
    save_peft: str | None = _arg(
        None,
        "at the end, write the LoRA adapters here for PEFT (PeftModel.from_pretrained of the "
        "Hugging Face model --load-hf or --save-hf names)",
    )
    # Mixture of experts (docs/moe.md; Megatron-Core's flags)
    num_experts: int | None = _arg(None, "experts of each MoE layer (default: dense MLPs only)")
    moe_router_topk: int = _arg(2, "experts each token is routed to")
    moe_ffn_hidden_size: int | None = _arg(None, "width of each expert (default ffn-hidden-size)")
    moe_shared_expert_intermediate_size: int | None = _arg(
        None, "width of a shared expert every token also goes through (default: none)"
    )
    moe_shared_expert_gate: bool = _arg(
        False, "scale the shared expert's output by a sigmoid gate (Qwen2-MoE)"
    )
    moe_layer_freq: str = _arg(
        "1",
        'which layers are MoE: every N-th ("2"), or one 0/1 per layer ("0,1,1,1", or Megatron\'s '
        '"([0]*1+[1]*3)")',
    )
    moe_router_score_function: str = _arg(
        "softmax", "router score function (sigmoid: DeepSeek-V3)", ("softmax", "sigmoid")
    )
    moe_router_pre_softmax: bool = _arg(
        False,
        "keep the top-k probabilities of the softmax over all experts (Qwen2-MoE, OLMoE); "
        "default: renormalised over the k (Mixtral, Qwen3-MoE)",
    )
    moe_router_topk_scaling_factor: float | None = _arg(
        None, "multiply the routing weights by this (DeepSeek-V3's routed_scaling_factor)"
    )
    moe_router_load_balancing_type: str = _arg(
        "aux_loss", "load balancing: the auxiliary loss, or none", ("aux_loss", "none")
    )
    moe_aux_loss_coeff: float = _arg(0.0, "coefficient of the load-balancing loss")
    moe_z_loss_coeff: float | None = _arg(None, "coefficient of the router z-loss (ST-MoE)")
    moe_expert_capacity_factor: float | None = _arg(
        None,
        "each expert takes at most ceil(tokens x k / experts x factor) of a rank's tokens, the "
        "others' routes are dropped (default: dropless)",
    )
    moe_token_dispatcher_type: str = _arg(
        "alltoall",
        "how tokens reach their experts' ranks: all-to-all of the routed tokens, or all-gather",
        ("alltoall", "allgather"),
    )
    moe_router_enable_expert_bias: bool = _arg(
        False,
        "DeepSeek-V3's balancing without an auxiliary loss (sigmoid scores): a per-expert bias "
        "for choosing, moved towards the mean load after every step",
    )
    moe_router_bias_update_rate: float = _arg(1e-3, "how far each expert's bias moves per step")
    moe_grouped_gemm: bool = _arg(
        True, "run each rank's experts as one grouped GEMM (--no-moe-grouped-gemm: a loop)"
    )
    # Parallelism and memory
    tensor_parallel_size: int = _arg(
        1, "tensor-parallel ranks (the rest of the world is data parallel)"
    )
    pipeline_model_parallel_size: int = _arg(1, "pipeline stages (world = TP x CP x DP x PP)")
    context_parallel_size: int = _arg(
        1,
        "context-parallel ranks: each holds seq-length / CP tokens of every sequence "
        "(two load-balanced chunks; seq-length divisible by 2 x CP)",
    )
    cp_comm_type: str = _arg(
        "p2p",
        "how attention crosses the context-parallel ranks: p2p (ring), a2a (Ulysses), allgather",
        ("p2p", "a2a", "allgather"),
    )
    expert_model_parallel_size: int = _arg(
        1, "expert-parallel ranks: each holds experts / EP of every MoE layer (divides TP x DP)"
    )
    virtual_pipeline_model_parallel_size: int | None = _arg(
        None, "model chunks per pipeline rank (N > 1 selects the interleaved schedule)"
    )
    pipeline_schedule: str | None = _arg(
        None,
        "pipeline schedule (default: interleaved with --virtual-pipeline-model-parallel-size > "
        "1, else 1f1b)",
        SCHEDULES,
    )
    pipeline_stage_layers: str | None = _arg(
        None, 'layers per (virtual) pipeline stage, e.g. "3,5" (default: an even split)'
    )
    sequence_parallel: bool = _arg(False, "sequence parallelism in norm/dropout regions")
    recompute: str = _arg("none", "activation recomputation", ("none", "selective", "full"))
    use_distributed_optimizer: bool = _arg(
        False,
        "shard fp32 master weights and AdamW moments over data parallelism (gradients "
        "reduce-scattered, parameters all-gathered)",
    )
    overlap_grad_reduce: bool = _arg(
        False, "reduce each gradient bucket over DP during the backward, as soon as it is complete"
    )
    overlap_param_gather: bool = _arg(
        False,
        "all-gather each parameter bucket during the next forward, just before its first use "
        "(needs --use-distributed-optimizer)",
    )
    ddp_bucket_size: int | None = _arg(
        None, "elements per gradient bucket (default 40M on GPU, 1M on CPU)"
    )
    grad_reduce_in_bf16: bool = _arg(
        False, "accumulate and reduce gradients in bf16 instead of fp32"
    )
    realtime_comm_threads: bool = _arg(
        False,
        "run gloo's communication threads at real-time priority (SCHED_RR 1; needs CAP_SYS_NICE or "
        "`ulimit -r 1`), so that CPU collectives overlapped with compute get a core at once; for "
        "groups on gloo (across hosts, or TPCORE_CPU_BACKEND=gloo): one host's groups use "
        "shared memory",
    )
    # Data
    data_path: str | None = _arg(None, "prefix of the .bin/.idx dataset (tpcore-preprocess output)")
    tokenizer: str = _arg("byte", '"byte" or the path of a tokenizer.json (must match the data)')
    valid_fraction: float = _arg(0.05, "fraction of the documents held out for validation")
    data_cache_path: str | None = _arg(
        None, "folder for the sample-index cache (default: beside the data)"
    )
    # Optimisation
    micro_batch_size: int = _arg(4, "samples per forward/backward on one data-parallel rank")
    global_batch_size: int | None = _arg(
        None, "samples per optimizer step over all DP ranks (default micro * DP)"
    )
    train_iters: int = _arg(100, "optimizer steps")
    lr: float = _arg(3e-4, "peak learning rate")
    min_lr: float = _arg(0.0, "learning rate at the end of the decay")
    lr_warmup_iters: int = _arg(0, "linear warmup steps from 0 to lr")
    lr_decay_style: str = _arg("cosine", "decay after warmup", ("cosine", "linear", "constant"))
    lr_decay_iters: int | None = _arg(
        None, "steps over which lr decays to min-lr (default train-iters)"
    )
    weight_decay: float = _arg(0.1, "AdamW weight decay (not applied to biases and norms)")
    adam_beta1: float = _arg(0.9, "AdamW beta1")
    adam_beta2: float = _arg(0.95, "AdamW beta2")
    adam_eps: float = _arg(1e-8, "AdamW epsilon")
    clip_grad: float = _arg(1.0, "clip the global gradient norm to this (0: no clipping)")
    bf16: bool = _arg(False, "bfloat16 model, fp32 master weights")
    fp16: bool = _arg(False, "float16 model, fp32 master weights, dynamic loss scaling")
    autocast: str = _arg(
        "none",
        "mixed precision with fp32 weights: forward under torch.autocast in this dtype (fp16 adds "
        "loss scaling)",
        ("none", "bf16", "fp16"),
    )
    initial_loss_scale: float = _arg(2.0**16, "fp16: starting loss scale")
    loss_scale_window: int = _arg(1000, "fp16: clean steps before the loss scale doubles")
    seed: int = _arg(1234, "random seed (initialisation, dropout, data order)")
    # Evaluation, logging, checkpoints
    eval_interval: int = _arg(100, "evaluate every this many steps (and at the end)")
    eval_iters: int = _arg(10, "validation batches per evaluation (0: no evaluation)")
    log_interval: int = _arg(
        10,
        "print a metrics line every this many steps (metrics.csv and TensorBoard get every step)",
    )
    log_dir: str | None = _arg(
        None, "metrics.csv, loss_curve.png, TensorBoard (default: --save, else no files)"
    )
    save: str | None = _arg(None, "checkpoint directory")
    save_interval: int | None = _arg(
        None, "checkpoint every this many steps (always at the end with --save)"
    )
    save_interval_minutes: float | None = _arg(
        None,
        "also checkpoint when this many minutes have passed since the last save (rank 0's "
        "clock, agreed at a step boundary)",
    )
    exit_signal_handler: bool = _arg(
        False,
        "on SIGTERM (what schedulers send before taking the nodes back) every rank finishes "
        "the step, a checkpoint is saved (with --save) and the run exits 0",
    )
    load: str | None = _arg(
        None, "resume from (or reshard) the latest checkpoint in this directory"
    )
    ckpt_format: str = _arg(
        "torch",
        "format of the checkpoints --save writes: torch (tpcore's files, one per TP x PP rank) or "
        "torch_dist (torch's distributed checkpoint, DCP); --load reads either",
        ("torch", "torch_dist"),
    )
    verify_checkpoint: bool = _arg(
        True,
        "check each checkpoint file's size and CRC-32 before loading it (--no-verify-checkpoint "
        "skips that extra read on huge checkpoints)",
    )
    max_skipped_steps: int = _arg(
        10,
        "stop with an error after this many consecutive steps skipped for NaN/inf gradients that "
        "fp16 loss scaling does not explain",
    )
    distributed_timeout_minutes: float = _arg(
        10.0,
        "a collective that waits longer than this for a peer rank fails, naming the training phase",
    )
    exit_interval: int | None = _arg(
        None, "stop after this many steps of this run (after any save due)"
    )
    device: str = _arg("auto", "cpu, cuda, or auto (cuda when available)", ("auto", "cpu", "cuda"))
    sample_tokens: int = _arg(0, "at the end, generate this many tokens from --sample-prompt")
    sample_prompt: str = _arg("\n", "prompt of the final sample")
    progress: bool = _arg(True, "progress bar on rank 0 when stdout is a terminal")

    def __post_init__(self) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ValueError(f"tpcore: training arguments: {what}")

        if self.load_hf:  # first: the model flags below are checked as the folder sets them
            apply_hf_architecture(self, {name: f.default for name, f in _FIELDS.items()}, need)
        for name in (
            "tensor_parallel_size",
            "pipeline_model_parallel_size",
            "micro_batch_size",
            "train_iters",
            "log_interval",
            "eval_interval",
            "seq_length",
            "loss_scale_window",
        ):
            need(
                isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                f"--{name.replace('_', '-')} must be an int >= 1, got {getattr(self, name)!r}",
            )
        for name in ("lr_warmup_iters", "eval_iters", "sample_tokens"):
            need(getattr(self, name) >= 0, f"--{name.replace('_', '-')} must be >= 0")
        for name, (kind, low, high) in _RANGES.items():
            _check_range(name, getattr(self, name), kind, low, high, need)
        cp = self.context_parallel_size
        need(
            not isinstance(cp, int) or cp < 1 or self.seq_length % (2 * cp) == 0,
            f"--seq-length {self.seq_length} is not divisible by 2 x --context-parallel-size "
            f"({2 * cp}): each context-parallel rank holds two equal chunks of every sequence",
        )
        need(
            self.max_position_embeddings is None or self.max_position_embeddings >= self.seq_length,
            f"--max-position-embeddings {self.max_position_embeddings} is shorter than "
            f"--seq-length {self.seq_length}",
        )
        need(not (self.bf16 and self.fp16), "--bf16 and --fp16 exclude each other")
        need(
            self.autocast == "none" or not (self.bf16 or self.fp16),
            "--autocast keeps fp32 weights: it excludes --bf16 and --fp16",
        )
        need(0 <= self.min_lr <= self.lr, f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr})")
        need(
            self.global_batch_size is None or self.global_batch_size >= 1,
            "--global-batch-size must be >= 1",
        )
        need(self.save_interval is None or self.save_interval >= 1, "--save-interval must be >= 1")
        need(self.exit_interval is None or self.exit_interval >= 1, "--exit-interval must be >= 1")
        need(
            not (self.ckpt_format == "torch_dist" and self.use_distributed_optimizer)
            or has_checkpointable(),
            "--ckpt-format torch_dist with --use-distributed-optimizer needs torch 2.15 or newer "
            "(DCP's CheckpointableTensor, for the optimizer's DP slices); use --ckpt-format torch",
        )
        need(
            self.lr_decay_iters is None or self.lr_decay_iters >= 1, "--lr-decay-iters must be >= 1"
        )
        need(
            type(self.max_skipped_steps) is int and self.max_skipped_steps >= 1,
            f"--max-skipped-steps must be an int >= 1, got {self.max_skipped_steps!r}",
        )
        need(
            type(self.distributed_timeout_minutes) in (int, float)
            and 0 < self.distributed_timeout_minutes < float("inf"),
            "--distributed-timeout-minutes must be a finite number > 0, got "
            f"{self.distributed_timeout_minutes!r}",
        )
        try:
            self.data_parallel_options()
        except ValueError as e:
            need(False, str(e).removeprefix("tpcore: "))
        for name, f in _FIELDS.items():
            choices = f.metadata["choices"]
            need(
                choices is None
                or getattr(self, name) in choices
                or (getattr(self, name) is None and "None" in str(f.type)),
                f"--{name.replace('_', '-')} must be one of {choices}, got {getattr(self, name)!r}",
            )
        config = self.model_config()  # validates the model shape now, with the GPTConfig message
        if self.save_hf:
            check_save_hf_paths(self, need)
            try:
                config_to_hf(config)
            except ValueError as e:
                need(False, f"--save-hf: {str(e).removeprefix('tpcore: ')}")
        self._check_pipeline(need)
        self._check_lora(need)
        check_moe_flags(self, need)
        if self.context_parallel_size > 1:  # attention dropout, a2a's head split
            try:
                self.model_config().check_cp(self.context_parallel_size, self.tensor_parallel_size)
            except ValueError as e:
                need(False, f"--context-parallel-size: {str(e).removeprefix('tpcore: ')}")

    def _check_lora(self, need) -> None:
        if self.lora_rank is None:
            given = [
                flag
                for flag, on in (
                    ("--lora-alpha", self.lora_alpha is not None),
                    ("--lora-dropout", self.lora_dropout != 0.0),
                    ("--lora-use-rslora", self.lora_use_rslora),
                    ("--lora-target-modules", self.lora_target_modules != "qkv,proj,fc1,fc2"),
                )
                if on
            ]
            verb = "needs" if len(given) == 1 else "need"
            need(not given, f"{', '.join(given)} {verb} --lora-rank (no adapters without it)")
            need(not self.save_peft, "--save-peft needs --lora-rank (there are no adapters)")
            return
        if self.save_peft:
            try:
                config_to_hf(self.model_config())
            except ValueError as e:
                need(False, f"--save-peft: {str(e).removeprefix('tpcore: ')}")
        targets = self.lora_targets()
        unknown = [t for t in targets if t not in LORA_LAYERS]
        need(
            targets and not unknown and len(set(targets)) == len(targets),
            f"--lora-target-modules must name some of {list(LORA_LAYERS)} once each, got "
            f"{self.lora_target_modules!r}",
        )
        mlp = [t for t in targets if t in ("fc1", "fc2")]
        need(
            self.num_experts is None or not mlp,
            f"--lora-target-modules {','.join(mlp)} with mixture-of-experts layers: LoRA "
            "adapters on expert weights are not supported yet; adapt the attention "
            "(--lora-target-modules qkv,proj)",
        )

    def lora_targets(self) -> list[str]:
        """--lora-target-modules as a list of GPTModel layer names."""
        return [t.strip() for t in self.lora_target_modules.split(",") if t.strip()]

    def _check_pipeline(self, need) -> None:
        pp, v = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        need(
            v is None or (isinstance(v, int) and v >= 1),
            f"--virtual-pipeline-model-parallel-size must be an int >= 1, got {v!r}",
        )
        v = v or 1
        if self.schedule == "interleaved":
            need(
                v >= 2,
                "--pipeline-schedule interleaved needs --virtual-pipeline-model-parallel-size >= 2",
            )
            need(
                pp >= 2,
                f"the interleaved schedule (--virtual-pipeline-model-parallel-size {v}) needs "
                "--pipeline-model-parallel-size >= 2",
            )
        else:
            need(
                v == 1,
                f"--virtual-pipeline-model-parallel-size {v} runs the interleaved schedule, not "
                f"--pipeline-schedule {self.schedule}",
            )
        try:
            self.stage_layers()
        except ValueError as e:
            need(False, str(e).removeprefix("tpcore: "))

    @property
    def schedule(self) -> str:
        """The pipeline schedule: --pipeline-schedule, else interleaved when
        --virtual-pipeline-model-parallel-size > 1 (Megatron's convention), else 1f1b."""
        if self.pipeline_schedule is not None:
            return self.pipeline_schedule
        return "interleaved" if (self.virtual_pipeline_model_parallel_size or 1) > 1 else "1f1b"

    def data_parallel_options(self) -> DataParallelOptions:
        """The gradient-buffer and optimizer choices (raises ValueError on a bad combination)."""
        return DataParallelOptions(
            overlap_grad_reduce=self.overlap_grad_reduce,
            use_distributed_optimizer=self.use_distributed_optimizer,
            overlap_param_gather=self.overlap_param_gather,
            grad_reduce_in_bf16=self.grad_reduce_in_bf16,
            bucket_size=self.ddp_bucket_size,
        )

    def stage_layers(self) -> list[list[int]]:
        """The layers of each (virtual) pipeline stage, from --pipeline-stage-layers or an even
        split."""
        counts = None
        if self.pipeline_stage_layers:
            try:
                counts = [int(x) for x in str(self.pipeline_stage_layers).split(",")]
            except ValueError:
                raise ValueError(
                    "tpcore: --pipeline-stage-layers must be comma-separated ints, got "
                    f"{self.pipeline_stage_layers!r}"
                ) from None
        stages = self.pipeline_model_parallel_size * (
            self.virtual_pipeline_model_parallel_size or 1
        )
        return split_layers(self.num_layers, stages, counts)

    def model_config(self, vocab_size: int = 1) -> GPTConfig:
        """The GPTConfig these arguments describe, for a tokenizer of `vocab_size` ids
        (with --load-hf: the folder's, whose vocabulary may be padded past the tokenizer's)."""
        if self.load_hf:
            return hf_model_config(self)
        return GPTConfig(
            vocab_size=vocab_size,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            kv_channels=self.kv_channels,
            qk_norm=self.qk_layernorm,
            qk_norm_scope=self.qk_norm_scope,
            max_position_embeddings=self.max_position_embeddings or self.seq_length,
            dropout=self.dropout,
            attention_dropout=self.attention_dropout,
            norm=self.norm,
            activation=self.activation,
            position_embedding=self.position_embedding,
            tie_embeddings=not self.untie_embeddings,
            embedding_scale=self.embedding_scale,
            bias=not self.disable_bias,
            sequence_parallel=self.sequence_parallel,
            recompute=self.recompute,
            fused_lm_head_loss=self.fused_lm_head_loss,
            cp_comm_type=self.cp_comm_type,
            **self.moe_options(),
        )

    def moe_options(self) -> dict:
        """The GPTConfig fields of the MoE flags (`moe_flags`)."""
        return moe_config_fields(self)

    def moe_run_options(self) -> dict:
        """The MoE flags that are run-time choices, not architecture (kept under --load-hf)."""
        return moe_run_fields(self)


_FIELDS = {f.name: f for f in dataclasses.fields(TrainArgs)}

# The range of each numeric flag that the checks in __post_init__ and GPTConfig leave out:
# name -> (kind, low, high); kind "int" (low <= value <= high), "[)" (low <= value < high),
# ">=" / ">" (a finite number above low); None: unbounded. Named ranges, because torch's
# errors (AdamW's "Invalid beta parameter at index 0: 1.5") name no flag, and NaN or inf
# fail late or never. tests/train/test_train_arguments.py tries bad values on every numeric field.
_RANGES: dict[str, tuple[str, float | None, float | None]] = {
    "max_position_embeddings": ("int", 1, None),
    "seed": (
        "int",
        0,
        2**32 - 2,
    ),  # the data order seeds numpy's RandomState with seed and seed + 1 (< 2**32)
    "valid_fraction": ("[)", 0.0, 1.0),
    "lr": (">=", 0.0, None),
    "min_lr": (">=", 0.0, None),
    "weight_decay": (">=", 0.0, None),
    "clip_grad": (">=", 0.0, None),
    "adam_beta1": ("[)", 0.0, 1.0),
    "adam_beta2": ("[)", 0.0, 1.0),
    "adam_eps": (">", 0.0, None),
    "initial_loss_scale": (">", 0.0, None),
    "embedding_scale": (">", 0.0, None),
    "lora_rank": ("int", 1, None),
    "lora_alpha": (">", 0.0, None),
    "lora_dropout": ("[)", 0.0, 1.0),
    "num_experts": ("int", 1, None),
    "moe_router_topk": ("int", 1, None),
    "expert_model_parallel_size": ("int", 1, None),
    "context_parallel_size": ("int", 1, None),
    "save_interval_minutes": (">", 0.0, None),
    "moe_ffn_hidden_size": ("int", 1, None),
    "moe_shared_expert_intermediate_size": ("int", 1, None),
    "moe_router_topk_scaling_factor": (">", 0.0, None),
    "moe_aux_loss_coeff": (">=", 0.0, None),
    "moe_z_loss_coeff": (">=", 0.0, None),
    "moe_expert_capacity_factor": (">", 0.0, None),
    "moe_router_bias_update_rate": (">", 0.0, None),
}

# GPTModel's parallel linear layers, the names --lora-target-modules takes.
LORA_LAYERS = ("qkv", "proj", "fc1", "fc2")


def _check_range(name: str, value, kind: str, low, high, need) -> None:
    """`need` a message naming --flag and its range unless `value` is in it (None passes)."""
    if value is None:
        return
    flag = "--" + name.replace("_", "-")
    if kind == "int":
        text = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
        ok = (
            isinstance(value, int)
            and not isinstance(value, bool)
            and low <= value
            and (high is None or value <= high)
        )
    else:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind == "[)":
            text, ok = f"in [{low:g}, {high:g})", number and low <= value < high
        else:
            text = f"a finite number {kind} {low:g}"
            ok = number and math.isfinite(value) and (value >= low if kind == ">=" else value > low)
    need(ok, f"{flag} must be {text}, got {value!r}")


def load_config_file(path: str) -> dict:
    """TrainArgs field values from a `.json`, `.yaml` or `.yml` file (keys with dashes or
    underscores), each as its field's type."""
    return read_config_file(path, _FIELDS)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="GPT pretraining with tensor and data parallelism (tpcore)",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument(
        "--config", help="YAML or JSON file of argument values (command-line flags override it)"
    )
    for name, f in _FIELDS.items():
        text = f.metadata["help"]
        # A help text that already says what the default means keeps it; others get the value.
        flag, help = (
            "--" + name.replace("_", "-"),
            text if "(default" in text else f"{text} (default: {f.default!r})",
        )
        kind = str(f.type).split(" ")[0]  # annotations are strings: "int", "int | None", ...
        if kind == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=help)
        else:
            p.add_argument(
                flag,
                type={"int": int, "float": float}.get(kind, str),
                choices=f.metadata["choices"],
                help=help,
            )
    return p


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    """TrainArgs from the command line (and `--config`); raises ValueError on bad values
    (argparse itself exits with a usage message on a malformed flag)."""
    given = vars(_parser().parse_args(argv))
    values = load_config_file(given.pop("config")) if "config" in given else {}
    values.update(given)
    check_given_flags(values)  # an explicit flag contradicting --load-hf, even at its default value
    return TrainArgs(**values)
