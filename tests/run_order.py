"""The order test files start in under `pytest -n 2 --dist loadfile`: longest first.

xdist hands each worker one file at a time, by default the files with the most tests first,
so files of a few long tests (a two-host launch waiting out a timeout) came last and one
worker ran them alone: in a replay of the 2026-11-30 fresh-clone run's durations with
xdist's rule, one worker finished 87 s after the other (437 s against 350 s); longest first,
both finish at 393 s. `make test` passes `--no-loadscope-reorder` so xdist keeps this order.
"""

from __future__ import annotations

# Seconds each file took (mean of two runs, 2026-11-30, 2-core Intel Xeon VM, empty caches);
# files under 4 s are left out and follow these in collection order.
FILE_SECONDS = {
    "tests/tensor_parallel/test_compile.py": 146,
    "tests/hf/test_hf.py": 77,
    "tests/train/test_train_two_hosts.py": 66,
    "tests/models/test_gpt.py": 29,
    "tests/comm/test_shm_sizes.py": 26,
    "tests/tensor_parallel/test_kernels_at_scale.py": 24,
    "tests/train/test_train.py": 22,
    "tests/test_docs.py": 22,
    "tests/train/test_train_preemption.py": 21,
    "tests/checkpoint/test_checkpoint_reshard.py": 20,
    "tests/hf/test_hf_launch.py": 19,
    "tests/train/test_train_context_parallel.py": 17,
    "tests/models/test_gpt_context_parallel.py": 15,
    "tests/train/test_train_moe.py": 15,
    "tests/checkpoint/test_checkpoint_pipeline.py": 14,
    "tests/optimizer/test_train_lookup_and_head.py": 14,
    "tests/train/test_train_lora.py": 14,
    "tests/train/test_train_faults.py": 14,
    "tests/train/test_attempt_store.py": 13,
    "tests/optimizer/test_train_distributed_optimizer.py": 11,
    "tests/comm/test_shm_torch_api.py": 11,
    "tests/checkpoint/test_checkpoint_distributed_optimizer.py": 11,
    "tests/models/test_generate.py": 10,
    "tests/comm/test_shutdown.py": 10,
    "tests/data/test_preprocess.py": 8,
    "tests/comm/test_shm_backend.py": 8,
    "tests/hf/test_hf_peft.py": 8,
    "tests/tensor_parallel/test_cross_entropy.py": 8,
    "tests/pipeline_parallel/test_pipeline.py": 8,
    "tests/checkpoint/test_checkpoint_experts.py": 7,
    "tests/train/test_hf_bridge_train.py": 6,
    "tests/models/test_hf_bridge_models.py": 6,
    "tests/comm/test_shm_faults.py": 6,
    "tests/models/test_gpt_init.py": 5,
    "tests/hf/test_hf_loading.py": 5,
    "tests/checkpoint/test_dcp.py": 5,
    "tests/test_rank_pool.py": 4,
}


def longest_files_first(items: list) -> None:
    """Reorder pytest `items` in place: the files of FILE_SECONDS, longest first, then the
    rest as collected; a file's tests keep their order."""
    position = {path: i for i, path in enumerate(FILE_SECONDS)}
    items.sort(key=lambda item: position.get(item.nodeid.split("::", 1)[0], len(position)))
