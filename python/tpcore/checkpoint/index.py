"""Finding a checkpoint in a save folder and reading its metadata, refusing clearly what
is not a checkpoint (garbage in `latest`, impossible values in metadata.json)."""

from __future__ import annotations

import json
import os
import re

from .errors import CheckpointError

__all__ = [
    "FORMAT",
    "VERSION",
    "TORCH_DIST_VERSION",
    "READABLE_VERSIONS",
    "find_checkpoint",
    "require_checkpoint",
    "read_latest",
    "newest_complete",
    "read_metadata",
    "model_file",
    "rng_file",
]

FORMAT = "tpcore-gpt-checkpoint"
VERSION = 4
TORCH_DIST_VERSION = 5
# 1: TP only, files model_tpRR.pt; 2: + pipeline; 3: + file checksums and shard identity;
# 4: + the distributed optimizer's state, sharded over DP (optim_tpRR_ppSS_dpDDD.pt);
# 5: the tensors in torch's distributed checkpoint (DCP) files ("ckpt_format": "torch_dist").
READABLE_VERSIONS = (1, 2, 3, 4, 5)
_NAME = re.compile(r"iter_(\d{7,})")
_FOLDER = re.compile(r"iter_(\d{7,})(\.old)?")


def model_file(directory: str, tp_rank: int, pp_rank: int, version: int = VERSION) -> str:
    name = (
        f"model_tp{tp_rank:02d}.pt" if version == 1 else f"model_tp{tp_rank:02d}_pp{pp_rank:02d}.pt"
    )
    return os.path.join(directory, name)


def rng_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rng_rank{rank:05d}.pt")


def read_latest(save_dir: str) -> str | None:
    """The checkpoint name `save_dir/latest` holds ("iter_0000100"), None without the file.
    Raises CheckpointError naming the file when it holds anything else."""
    path = os.path.join(save_dir, "latest")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(256)
    except OSError as e:
        raise CheckpointError(f"tpcore: cannot read {path}: {e}") from e
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or not _NAME.fullmatch(name):
        raise CheckpointError(
            f"tpcore: {path} should hold the name of a checkpoint folder such as 'iter_0000100', "
            f"but holds {raw[:40]!r}: the file is damaged; delete it to resume from the newest "
            "complete iter_* folder, or write that folder's name into it"
        )
    return name


def newest_complete(save_dir: str) -> str | None:
    """The newest `iter_N` folder of `save_dir` that holds a metadata.json (written last, so
    its presence means the save finished), preferring `iter_N` to a re-save's `iter_N.old`."""
    try:
        entries = os.listdir(save_dir)
    except OSError:
        return None
    found = []
    for entry in entries:
        m = _FOLDER.fullmatch(entry)
        if m and os.path.isfile(os.path.join(save_dir, entry, "metadata.json")):
            found.append((int(m.group(1)), m.group(2) is None, entry))
    return os.path.join(save_dir, max(found)[2]) if found else None


def require_checkpoint(path: str) -> str:
    """`find_checkpoint(path)`, or a CheckpointError saying why nothing is there: the path
    does not exist, or holds no checkpoint."""
    directory = find_checkpoint(path)
    if directory is not None:
        return directory
    if not os.path.exists(path):
        raise CheckpointError(f"tpcore: checkpoint path {path} does not exist (a typo?)")
    raise CheckpointError(
        f"tpcore: no checkpoint in {path} (no metadata.json and no 'latest' file)"
    )


def find_checkpoint(path: str) -> str | None:
    """The checkpoint folder `path` names: itself if it holds metadata.json, else the one
    its `latest` file points to, else (no `latest`) its newest complete `iter_N` folder;
    None when `path` holds no checkpoint. Raises CheckpointError when `latest` is damaged
    or points to no complete checkpoint, or when `iter_N` folders exist but none is complete
    (so that a run never starts from scratch over checkpoints it failed to find)."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    name = read_latest(path)
    if name is None:
        newest = newest_complete(path)
        if newest is None and os.path.isdir(path):
            partial = sorted(e for e in os.listdir(path) if _FOLDER.fullmatch(e))
            if partial:
                raise CheckpointError(
                    f"tpcore: {path} holds checkpoint folders ({', '.join(partial[-3:])}) but no "
                    "'latest' file and none of them is complete (no metadata.json); refusing to "
                    "start from scratch over them"
                )
        return newest
    latest = os.path.join(path, "latest")
    target = os.path.join(path, name)
    if not os.path.exists(target) and os.path.isfile(
        os.path.join(target + ".old", "metadata.json")
    ):
        target += ".old"  # killed while re-saving this iteration: the previous copy is complete
    if not os.path.isfile(os.path.join(target, "metadata.json")):
        raise CheckpointError(
            f"tpcore: {latest} points to {target}, which is not a complete checkpoint"
        )
    return target


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def read_metadata(directory: str) -> dict:
    """A checkpoint's metadata.json (format 1, 2 or 3), its values checked: a damaged or
    hand-edited file is refused here, naming the file and the field, rather than failing
    later as an IndexError deep in the data pipeline."""
    path = os.path.join(directory, "metadata.json")
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"tpcore: cannot read checkpoint metadata {path}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"tpcore: {path} is not a {FORMAT} checkpoint")
    if meta.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"tpcore: {path} is a {FORMAT} of version {meta.get('version')!r}; this tpcore reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))} (was it written by a "
            "newer tpcore?)"
        )
    checks = {"iteration": 0, "tensor_parallel_size": 1, "world_size": 1}
    if "consumed_samples" in meta:
        checks["consumed_samples"] = 0
    if meta["version"] >= 2:
        checks["pipeline_parallel_size"] = 1
    if meta.get("distributed_optimizer"):
        checks["data_parallel_size"] = 1
    for key, low in checks.items():
        if not _is_int(meta.get(key), low):
            raise CheckpointError(
                f"tpcore: {path}: {key!r} must be an integer >= {low}, got {meta.get(key)!r} (the "
                "file is damaged)"
            )
    if not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(
            f"tpcore: {path}: 'model_config' is missing or not a mapping (the file is damaged)"
        )
    if meta["version"] >= 3:
        files = meta.get("files")
        if not isinstance(files, dict) or not all(
            isinstance(r, dict) and {"bytes", "crc32"} <= set(r) for r in files.values()
        ):
            raise CheckpointError(
                f"tpcore: {path}: 'files' (each file's size and CRC-32) is missing or damaged"
            )
        for key in ("run_id", "save_id"):
            if not isinstance(meta.get(key), str):
                raise CheckpointError(f"tpcore: {path}: {key!r} is missing (the file is damaged)")
    return meta
