"""Checkpoints that cannot be half-written: every save a fresh folder, published with its
marker last; nothing that differs from what the marker recorded is ever loaded."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from distutil import run_ranks

from dynpipe.runtime.checkpoint import (
    META_FILE,
    CheckpointCorrupt,
    list_checkpoints,
    load_checkpoint,
    newest_checkpoint,
    read_marker,
)
from dynpipe.runtime.checkpointer import Checkpointer


def _state(value: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = {"a.weight": torch.full((4, 3), value), "a.bias": torch.full((4,), value)}
    optim = {"a.weight/step": torch.tensor(value), "a.weight/exp_avg": torch.full((4, 3), value)}
    return model, optim


def _save(ckpt: Checkpointer, step: int, value: float, **kw) -> Path:
    model, optim = _state(value)
    path = ckpt.save(step=step, model_state=model, optim_state=optim, meta={"step": step}, **kw)
    ckpt.wait()
    return path


def _load(path: Path) -> tuple[float, int]:
    model, _ = _state(0.0)
    optim, meta = load_checkpoint(path, model_state=model, held_params={"a.weight"})
    assert torch.equal(model["a.bias"], torch.full((4,), model["a.weight"][0, 0].item()))
    assert float(optim["a.weight/exp_avg"][0, 0]) == float(model["a.weight"][0, 0])
    return float(model["a.weight"][0, 0]), meta["step"]


def test_each_save_is_a_fresh_folder_and_the_newest_are_kept(tmp_path) -> None:
    ckpt = Checkpointer(tmp_path, keep=2, run_id="r")
    paths = [_save(ckpt, step, float(step)) for step in (2, 4, 6, 8)]
    assert len({p.name for p in paths}) == 4
    done, skipped = list_checkpoints(tmp_path)
    assert [c.path for c in done] == paths[2:] and not skipped
    assert [c.seq for c in done] == [3, 4]
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in paths[2:])
    marker = json.loads((paths[-1] / META_FILE).read_text())
    assert marker["save_id"] in paths[-1].name and marker["run_id"] == "r"
    for name, rec in marker["files"].items():
        data = (paths[-1] / name).read_bytes()
        assert len(data) == rec["size"] and hashlib.sha256(data).hexdigest() == rec["sha256"]
    assert _load(tmp_path) == (8.0, 8)  # a save folder loads its newest checkpoint


def test_a_background_save_copies_the_state_before_returning(tmp_path) -> None:
    ckpt = Checkpointer(tmp_path, run_id="r")
    model, optim = _state(1.0)
    path = ckpt.save(step=1, model_state=model, optim_state=optim, meta={"step": 1})
    for t in (*model.values(), *optim.values()):
        t.add_(100.0)  # training goes on while the save is written
    (record,) = ckpt.wait()
    assert record.path == path and record.bytes > 0 and record.stall_ms >= 0
    assert _load(path) == (1.0, 1)


def test_an_unfinished_save_is_never_loaded_and_is_cleaned_up(tmp_path) -> None:
    ckpt = Checkpointer(tmp_path, keep=3, run_id="r")
    good = _save(ckpt, 2, 2.0)
    # A save killed while writing (still under its temporary name), and one killed between
    # its rename and its marker.
    torn = _save(ckpt, 4, 4.0)
    shutil.copytree(torn, tmp_path / ".tmp-ckpt-00000006-aaaaaaaaaaaa")
    (torn / META_FILE).unlink()
    assert newest_checkpoint(tmp_path).path == good
    assert _load(tmp_path) == (2.0, 2)
    with pytest.raises(CheckpointCorrupt, match="save never finished"):
        read_marker(torn)
    _save(ckpt, 8, 8.0)
    assert not torn.exists() and not (tmp_path / ".tmp-ckpt-00000006-aaaaaaaaaaaa").exists()


def test_resuming_from_an_older_step_never_rewrites_a_published_checkpoint(tmp_path) -> None:
    run_a = Checkpointer(tmp_path, keep=10, run_id="A")
    a_paths = {step: _save(run_a, step, float(step)) for step in (2, 4, 6)}
    a_markers = {s: (p / META_FILE).read_bytes() for s, p in a_paths.items()}
    # Run B resumed from A's step 2 and saves its own step 4 into the same folder.
    assert _load(a_paths[2]) == (2.0, 2)
    run_b = Checkpointer(tmp_path, keep=10, run_id="B")
    b4 = _save(run_b, 4, 40.0)
    assert b4 != a_paths[4]
    for step, path in a_paths.items():  # A's checkpoints are as A published them
        assert (path / META_FILE).read_bytes() == a_markers[step]
        assert _load(path) == (float(step), step)
    assert _load(b4) == (40.0, 4)
    assert newest_checkpoint(tmp_path).path == b4  # published last
    assert newest_checkpoint(tmp_path, run_id="A").path == a_paths[6]


def _swap_from_other_save(ckpt: Path, other: Path) -> Path:
    # A file whose bytes differ between the saves (a rank's state is spread over files).
    name = next(
        f.name
        for f in sorted(ckpt.glob("*.distcp"))
        if f.read_bytes() != (other / f.name).read_bytes()
    )
    shutil.copy(other / name, ckpt / name)
    return ckpt


def _flip_a_byte(ckpt: Path, other: Path) -> Path:
    f = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    return ckpt


def _rename_to_other_save(ckpt: Path, other: Path) -> Path:
    return ckpt.rename(ckpt.with_name(ckpt.name[:-12] + "0" * 12))


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (_swap_from_other_save, "does not match the SHA-256"),
        (_flip_a_byte, "does not match the SHA-256"),
        (_rename_to_other_save, "files of two saves are mixed"),
    ],
)
def test_mixed_or_altered_files_are_refused(tmp_path, damage, needle: str) -> None:
    ckpt = Checkpointer(tmp_path / "d", keep=5, run_id="r")
    first = _save(ckpt, 2, 2.0)
    second = _save(ckpt, 4, 4.0)
    path = damage(second, first)
    with pytest.raises(CheckpointCorrupt, match=needle):
        _load(path)


def test_a_crafted_index_runs_no_code_even_with_a_matching_marker(tmp_path) -> None:
    import pickle

    ckpt = Checkpointer(tmp_path / "d", run_id="r")
    path = _save(ckpt, 2, 2.0)
    ran = tmp_path / "ran"

    class Boom:
        def __reduce__(self):
            return (Path.touch, (ran,))

    blob = pickle.dumps(Boom())
    (path / ".metadata").write_bytes(blob)
    marker = json.loads((path / META_FILE).read_text())
    marker["files"][".metadata"] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (path / META_FILE).write_text(json.dumps(marker))
    with pytest.raises(CheckpointCorrupt, match="could run code"):
        _load(path)
    assert not ran.exists()


def _die_while_saving(rank: int, world: int, root: str) -> str:
    """Both ranks publish step 2; while saving step 4, rank 1 dies after writing its data
    but before the folder is published."""
    from dynpipe.runtime import checkpointer as ck
    from dynpipe.runtime.checkpoint import CheckpointError

    ckpt = ck.Checkpointer(root, rank=rank, run_id="r", timeout_s=20)
    model, optim = _state(2.0 + rank)
    model = {f"r{rank}.{k}": v for k, v in model.items()}
    optim = {f"r{rank}.{k}": v for k, v in optim.items()}
    ckpt.save(step=2, model_state=model, optim_state=optim, meta={"step": 2})
    ckpt.wait()
    if rank == 1:
        ck.file_sha256 = lambda path: os._exit(9)  # killed between writing and publishing
    ckpt.save(step=4, model_state=model, optim_state=optim, meta={"step": 4})
    try:
        ckpt.wait()
    except CheckpointError as exc:
        return str(exc)
    return "published"


@pytest.mark.slow
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint_newest(tmp_path) -> None:
    res = run_ranks(_die_while_saving, 2, str(tmp_path), timeout_s=180, expect_failure=True)
    assert not res[1]["ok"]
    assert res[0]["ok"] and "saving a checkpoint failed" in res[0]["value"], res[0]
    done, _ = list_checkpoints(tmp_path)
    assert [c.step for c in done] == [2]
    assert any(p.name.startswith(".tmp-ckpt-00000004") for p in tmp_path.iterdir())
    # Every rank's state of step 2, from the one published folder, into one process.
    for rank in (0, 1):
        model = {f"r{rank}.{k}": torch.zeros_like(v) for k, v in _state(0.0)[0].items()}
        _, meta = load_checkpoint(tmp_path, model_state=model, held_params=set())
        assert meta["step"] == 2
        assert all(float(v.flatten()[0]) == 2.0 + rank for v in model.values())
