"""Checkpoint integrity (issue 22): a shard damaged inside, shards swapped between TP ranks
or taken from another save, a full disk, non-finite weights, garbage in `latest`, impossible
metadata, a missing `latest`; each raises on every rank naming the file and the cause, and
leaves what was on disk as it was (checked by content). Formats 1 and 2 still load."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import zipfile

import pytest
import torch
import torch.distributed as dist

from checks import GPT_VARIANTS, setup_tp
from tpcore.checkpoint import integrity as checkpoint_integrity
from tpcore.checkpoint.index import read_metadata
from tpcore.models import GPTModel
from tpcore.train import (
    CheckpointError,
    convert,
    find_checkpoint,
    load_checkpoint,
    load_dense_state_dict,
    save_checkpoint,
)
from train_checks import make_adamw, tp_dp_groups

CONFIG = GPT_VARIANTS["llama"]


def _make(seed: int):
    torch.manual_seed(seed)
    model = GPTModel(CONFIG)
    return model, make_adamw(model, CONFIG)


def _save(model, opt, save: str, iteration: int) -> str:
    tp_group, dp_group = tp_dp_groups()
    return save_checkpoint(
        save, iteration, model, opt, consumed_samples=0, tp_group=tp_group, dp_group=dp_group
    )


def _digest(folder: str) -> dict[str, str]:
    """Every file under `folder` by relative path -> sha256 of its bytes."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(
                    f.read()
                ).hexdigest()
    return out


def _on_rank0(rank: int, fn) -> None:
    if rank == 0:
        fn()
    dist.barrier()


def _every_rank_raises(match: str, fn, *args, **kwargs) -> str:
    """`fn` raises CheckpointError containing `match` (on this rank; called on every rank)."""
    try:
        fn(*args, **kwargs)
    except CheckpointError as e:
        assert match in str(e), f"expected {match!r} in: {e}"
        return str(e)
    raise AssertionError(f"nothing raised; expected {match!r}")


def _middle_of_largest_tensor(path: str) -> int:
    """The file offset of the middle of the largest tensor record of a torch.save zip file."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    assert info.file_size >= 8192 and info.compress_type == zipfile.ZIP_STORED, info
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len + info.file_size // 2


def _damaged_shards(rank, world, root):
    """World 4 = TP 2 x DP 2: a 4 KiB patch of random bytes inside a shard, swapped shards,
    a shard of another save; every rank raises naming the file before training on it."""
    setup_tp(2, replicas=True)
    tp_group, _ = tp_dp_groups()
    model, opt = _make(0)
    good = _save(model, opt, os.path.join(root, "run_a"), 5)
    other = _save(
        *_make(1), os.path.join(root, "run_b"), 5
    )  # same shapes, same iteration, another run
    corrupt, swapped, foreign = (os.path.join(root, n) for n in ("corrupt", "swapped", "foreign"))

    def damage():
        for folder in (corrupt, swapped, foreign):
            shutil.copytree(good, folder)
        path = os.path.join(corrupt, "model_tp00_pp00.pt")
        with open(path, "r+b") as f:  # inside the largest tensor's bytes, which no reader checks
            f.seek(_middle_of_largest_tensor(path) - 2048)
            f.write(os.urandom(4096))
        a, b = (os.path.join(swapped, f"model_tp{r:02d}_pp00.pt") for r in (0, 1))
        os.rename(a, a + ".x"), os.rename(b, a), os.rename(a + ".x", b)
        shutil.copy(
            os.path.join(other, "model_tp01_pp00.pt"), os.path.join(foreign, "model_tp01_pp00.pt")
        )

    _on_rank0(rank, damage)
    fresh, fresh_opt = _make(2)
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    load = dict(tp_group=tp_group)
    # Every rank names the damaged file and the cause (those that did not read it quote the
    # one that did).
    _every_rank_raises(
        f"{corrupt}/model_tp00_pp00.pt is corrupt: CRC-32",
        load_checkpoint,
        corrupt,
        fresh,
        fresh_opt,
        **load,
    )
    msg = _every_rank_raises(
        f"{swapped}/model_tp0", load_checkpoint, swapped, fresh, fresh_opt, **load
    )
    assert (
        "holds the bytes the metadata records for model_tp0" in msg
        and "shard files swapped or renamed" in msg
    ), msg
    _every_rank_raises(
        f"{foreign}/model_tp01_pp00.pt is corrupt",
        load_checkpoint,
        foreign,
        fresh,
        fresh_opt,
        **load,
    )
    # Without the checksums (--no-verify-checkpoint), the identity each shard records still
    # catches them.
    load["verify"] = False
    _every_rank_raises(
        "is not the shard this checkpoint expects at TP rank 0, PP rank 0 "
        "(a file of another rank, save or run?): "
        "tensor_parallel_rank: file 1, metadata 0",
        load_checkpoint,
        swapped,
        fresh,
        fresh_opt,
        **load,
    )
    msg = _every_rank_raises(
        f"{foreign}/model_tp01_pp00.pt is not the shard this checkpoint expects at TP rank 1",
        load_checkpoint,
        foreign,
        fresh,
        fresh_opt,
        **load,
    )
    assert "run_id: file" in msg and "save_id: file" in msg, msg
    for name, p in fresh.named_parameters():  # loading nothing half-way either
        assert torch.equal(p.detach(), before[name]), name
    load_checkpoint(good, fresh, fresh_opt, tp_group=tp_group)  # the intact checkpoint still loads
    for (name, p), q in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
    dist.barrier()


@pytest.fixture(scope="module")
def damaged(cpu_ranks, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("integrity"))
    cpu_ranks.run(_damaged_shards, root)
    return root


def test_damaged_swapped_and_foreign_shards_fail_on_every_rank(damaged):
    assert os.path.isdir(os.path.join(damaged, "corrupt"))


def test_convert_refuses_a_damaged_checkpoint(damaged, tmp_path, capsys):
    pytest.importorskip("safetensors")
    out = str(tmp_path / "dense.safetensors")
    bad = os.path.join(damaged, "corrupt", "model_tp00_pp00.pt")
    with pytest.raises(CheckpointError, match=f"{bad} is corrupt: CRC-32"):
        convert.export_safetensors(os.path.join(damaged, "corrupt"), out)
    assert convert.main(["--load", os.path.join(damaged, "corrupt"), "--output", out]) == 1
    assert f"{bad} is corrupt" in capsys.readouterr().err
    assert not os.path.exists(out) and os.listdir(tmp_path) == []
    assert (
        convert.main(["--load", os.path.join(damaged, "run_a"), "--output", out]) == 0
    )  # the intact one exports


def _save_failures(rank, world, root):
    """A full disk while rank 1 writes its shard, then non-finite weights on rank 2: every
    rank raises naming the cause and the file; iter_N.tmp is removed; the previous
    checkpoint and `latest` are untouched (compared by content)."""
    setup_tp(2, replicas=True)
    model, opt = _make(0)
    save = os.path.join(root, "save")
    _save(model, opt, save, 1)
    before = _digest(save)
    dist.barrier()
    write = checkpoint_integrity._ChecksumWriter.write
    if rank == 1:  # TP rank 1 of DP rank 0: it writes model_tp01_pp00.pt

        def full_disk(self, data):
            self.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise self.error

        checkpoint_integrity._ChecksumWriter.write = full_disk
    try:
        _every_rank_raises(
            (
                f"writing {save}/iter_0000002.tmp/model_tp01_pp00.pt failed: "
                "ENOSPC (No space left on device): the disk is full"
            ),
            _save,
            model,
            opt,
            save,
            2,
        )
    finally:
        checkpoint_integrity._ChecksumWriter.write = write
    dist.barrier()
    assert _digest(save) == before, "a failed save changed the save folder"
    if rank == 0:  # a writer (TP rank 0 of DP rank 0): the others quote its error
        with torch.no_grad():
            model.layers[1].mlp.fc2.weight[0, 0] = float("nan")
    _every_rank_raises("hold NaN or inf values (the run has diverged)", _save, model, opt, save, 2)
    dist.barrier()
    assert _digest(save) == before, "a checkpoint of non-finite weights was written"


def test_full_disk_and_nan_weights_fail_every_rank_and_keep_the_last_checkpoint(
    cpu_ranks, tmp_path
):
    cpu_ranks.run(_save_failures, str(tmp_path))


def test_latest_garbage_negative_iteration_and_missing_latest(damaged, tmp_path):
    src = os.path.join(damaged, "run_a", "iter_0000005")
    save = tmp_path / "save"
    shutil.copytree(src, save / "iter_0000005")
    shutil.copytree(src, save / "iter_0000003")
    (save / "latest").write_bytes(b"\x00\xffPK\x03\x04 garbage")
    with pytest.raises(
        CheckpointError, match=f"{save}/latest should hold the name of a checkpoint folder"
    ):
        find_checkpoint(str(save))
    (save / "latest").unlink()  # no `latest`: the newest complete iter_N, never "nothing here"
    assert find_checkpoint(str(save)) == str(save / "iter_0000005")
    os.remove(save / "iter_0000005" / "metadata.json")  # incomplete: the older complete one
    assert find_checkpoint(str(save)) == str(save / "iter_0000003")
    os.remove(save / "iter_0000003" / "metadata.json")
    with pytest.raises(CheckpointError, match="no 'latest' file and none of them is complete"):
        find_checkpoint(str(save))
    bad = tmp_path / "negative"
    shutil.copytree(src, bad)
    meta = json.loads((bad / "metadata.json").read_text())
    (bad / "metadata.json").write_text(json.dumps({**meta, "iteration": -3}))
    with pytest.raises(
        CheckpointError, match=f"{bad}/metadata.json: 'iteration' must be an integer >= 0, got -3"
    ):
        load_dense_state_dict(str(bad))


def test_format_2_checkpoints_without_checksums_still_load(damaged, tmp_path):
    src = os.path.join(damaged, "run_a", "iter_0000005")
    old = tmp_path / "v2"
    shutil.copytree(src, old)
    meta = read_metadata(str(old))
    for key in ("files", "run_id", "save_id"):
        del meta[key]
    (old / "metadata.json").write_text(json.dumps({**meta, "version": 2}))
    for name in os.listdir(old):  # shards of format 2 record no identity
        if name.startswith("model_"):
            state = torch.load(old / name, weights_only=True)
            del state["identity"]
            torch.save(state, old / name)
    (_, want), (_, got) = load_dense_state_dict(src), load_dense_state_dict(str(old))
    assert want.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in want.items())
