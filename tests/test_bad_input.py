"""Every bad input ``dynpipe train`` and ``dynpipe figures`` can be given: one line that says
what is wrong and how to fix it, exit status 2, no traceback, before any worker starts."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from dynpipe.cli import main

MLP = ["--model-arg", "depth=4", "--model-arg", "width=16"]


def _one_line(capsys, argv: list[str], *needles: str) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, lines
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--model-arg", "nosuch=1"], ["no setting 'nosuch'", "depth"]),
        (["--model-arg", "depth=abc"], ["depth takes an integer", "'abc'", "depth=8"]),
        (["--model-arg", "depth=0"], ["depth=0", "depth must be >= 1"]),
        (["--model", "usermodel_bad:stack", "--model-arg", "nosuch=1"], ["no setting 'nosuch'"]),
        (["--model", "usermodel_bad:stack", "--model-arg", "depth=abc"], ["takes an integer"]),
        (["--model", "usermodel_bad:stack", "--model-arg", "depth=0"], ["has no layers"]),
        (["--model", "usermodel_bad:linear"], ["returned Linear", "nn.Sequential"]),
        (["--model", "usermodel_bad:nothing"], ["returned NoneType"]),
        (["--model", "usermodel_bad:empty"], ["has no layers"]),
        (["--microbatches", "0"], ["--microbatches must be >= 1"]),
        (["--cpu-threads", "0"], ["--cpu-threads must be >= 1, got 0"]),
        (["--keep-checkpoints", "0"], ["--keep-checkpoints must be >= 1"]),
        (["--max-restarts", "2"], ["--max-restarts 2 needs --save-every K --save-dir DIR"]),
        (["--resume", "auto"], ["--resume auto needs --save-dir"]),
        (["--adapt", "measured", "--predictor", "p.json"], ["--predictor is read only by"]),
        (["--predictor", "p.json"], ["--adapt static"]),
        (["--model", "gpt", "--data", "text"], ["--data text needs --data-path FILE"]),
        (["--model", "vgg16", "--data", "cifar10"], ["--data cifar10 needs --data-path DIR"]),
    ],
)
def test_bad_train_arguments(capsys, args: list[str], needles: list[str]) -> None:
    _one_line(capsys, ["train", "--nproc", "2", *args], *needles)


def test_plan_rank_must_be_an_integer(tmp_path, capsys) -> None:
    plan = {
        "model": "mlp",
        "num_layers": 10,
        "stages": [{"start": 0, "stop": 5, "rank": 0}, {"start": 5, "stop": 10, "rank": "1"}],
    }
    (tmp_path / "p.json").write_text(json.dumps(plan))
    _one_line(capsys, ["train", "--plan", str(tmp_path / "p.json")], "rank '1'", "integer")


@pytest.mark.parametrize(
    ("line", "needle"),
    [('step = "soon"', "step must be an integer, got 'soon'"), ('factor = "big"', "factor")],
)
def test_scenario_values_must_be_numbers(tmp_path, capsys, line: str, needle: str) -> None:
    fields = {"step": "step = 3", "factor": "factor = 2.0"}
    fields[line.split()[0]] = line
    (tmp_path / "s.toml").write_text(
        '[[events]]\naction = "start"\nstage = 1\nkind = "emulate"\n'
        + "\n".join(fields.values())
        + "\n"
    )
    argv = ["train", "--nproc", "2", "--adapt", "measured", "--scenario", str(tmp_path / "s.toml")]
    _one_line(capsys, argv, needle)


def test_figures_on_a_binary_file(tmp_path, capsys) -> None:
    (tmp_path / "x.jsonl").write_bytes(bytes(range(256)) * 8)
    argv = ["figures", str(tmp_path / "x.jsonl"), "-o", str(tmp_path / "f")]
    _one_line(capsys, argv, "no header record")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_device_cuda_without_a_gpu_suggests_cpu(capsys) -> None:
    line = _one_line(capsys, ["train", "--nproc", "2", "--device", "cuda"], "--device cpu")
    assert "--nproc 0" not in line


# ------------------------------------------------------------------ predictors


def test_predictor_that_is_not_one(tmp_path, capsys) -> None:
    # Fixed bytes, not random ones: a first byte of 0x78 ('x', zlib's header) or 0x80 would
    # read as an old pickled predictor, one random file in 128.
    (tmp_path / "rand.bin").write_bytes(bytes(range(1, 121)) * 16)
    argv = ["train", "--adapt", "adaptive", "--predictor", str(tmp_path / "rand.bin")]
    _one_line(capsys, argv, "not a dynpipe predictor")


def test_predictor_schema_checked_before_step_0(tmp_path, capsys) -> None:
    """A predictor fitted on other telemetry is refused by the launcher, not at the first
    adaptive decision."""
    from dynpipe.predictor import fit_predictor, save_predictor
    from dynpipe.predictor.synthetic import synthetic_profiles

    df = synthetic_profiles(seed=0).drop(columns=["tel_power_w"])
    pred = fit_predictor(df, estimator="ridge")
    path = save_predictor(pred, tmp_path / "p.json")
    argv = ["train", "--nproc", "2", "--adapt", "adaptive", "--predictor", str(path)]
    _one_line(capsys, argv, "the telemetry dynpipe train samples", "extra tel_power_w")


# ----------------------------------------------------------------- checkpoints


def _checkpoint(root: Path, *, width: int = 16, meta: dict | None = None) -> Path:
    """A real checkpoint of mlp(depth=4, width) at step 3, written in this process."""
    from dynpipe.models import get_model
    from dynpipe.runtime.checkpointer import save_checkpoint

    model = get_model("mlp", depth=4, width=width)
    layers = model.build_range(0, len(model))
    state = {f"{n}.{k}": v for n, layer in layers.items() for k, v in layer.state_dict().items()}
    meta = {"step": 3, "model": "mlp", "model_fingerprint": model.fingerprint(), **(meta or {})}
    return save_checkpoint(root, model_state=state, optim_state={}, meta=meta)


def _data_file(ckpt: Path) -> Path:
    return next(ckpt.glob("*.distcp"))


def _crafted_index(ckpt: Path) -> None:
    """A .metadata that would run code when unpickled, with the marker updated to match (what
    someone handing over a checkpoint could do)."""
    import hashlib
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {ckpt.parent / 'ran'}",))

    blob = pickle.dumps(Boom())
    (ckpt / ".metadata").write_bytes(blob)
    marker = json.loads((ckpt / "dynpipe.json").read_text())
    marker["files"][".metadata"] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (ckpt / "dynpipe.json").write_text(json.dumps(marker))


CORRUPTIONS = {
    "truncated data file": (lambda c: os.truncate(_data_file(c), 100), "truncated or altered"),
    "truncated index": (lambda c: os.truncate(c / ".metadata", 10), "truncated or altered"),
    "missing index": (lambda c: (c / ".metadata").unlink(), ".metadata is missing"),
    "garbage marker": (
        lambda c: (c / "dynpipe.json").write_text("{not json"),
        "not a readable checkpoint marker",
    ),
    "marker removed": (lambda c: (c / "dynpipe.json").unlink(), "save never finished"),
    "crafted index": (_crafted_index, "refusing to load it"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_resume_from_a_damaged_checkpoint(tmp_path, capsys, case: str) -> None:
    ckpt = _checkpoint(tmp_path / "ck")
    damage, needle = CORRUPTIONS[case]
    damage(ckpt)
    argv = ["train", "--nproc", "2", *MLP, "--resume", str(ckpt)]
    _one_line(capsys, argv, needle)
    assert not (tmp_path / "ran").exists()  # nothing in the checkpoint ran


def test_resume_with_other_layer_shapes(tmp_path, capsys) -> None:
    ckpt = _checkpoint(tmp_path / "ck", width=32)
    argv = ["train", "--nproc", "2", *MLP, "--resume", str(ckpt)]
    _one_line(capsys, argv, "holds inp.0.weight with shape [32, 32] but this model's is [16, 32]")


def test_resume_with_another_optimizer(tmp_path, capsys) -> None:
    """An SGD checkpoint resumed with the default AdamW would start its moments from zero
    and drop its momentum silently."""
    saved = {"name": "sgd", "lr": 0.02, "clip_grad": 1.0}
    ckpt = _checkpoint(tmp_path / "ck", meta={"config": {"optim": saved}})
    argv = ["train", "--nproc", "2", *MLP, "--resume", str(ckpt)]
    _one_line(capsys, argv, "trained with --optimizer sgd (lr 0.02)", "asks for --optimizer adamw")


def test_resume_from_a_checkpoint_at_the_last_step_or_past_it(tmp_path, capsys) -> None:
    """A run that would train no step says so, rather than exit 0 with a log whose end
    precedes its start."""
    ckpt = _checkpoint(tmp_path / "ck")
    for steps in ("3", "2"):
        argv = ["train", "--nproc", "2", *MLP, "--resume", str(ckpt), "--steps", steps]
        _one_line(capsys, argv, f"is at step 3 and --steps is {steps}", "--steps above 3")


def test_resumed_optimizer_settings_that_differ_are_listed() -> None:
    from dynpipe.runtime.optim import OptimConfig, check_resumed_optim

    saved = dataclasses.asdict(OptimConfig(name="adamw", lr=3e-4))
    saved["betas"] = list(saved["betas"])  # as a JSON round trip leaves it
    assert check_resumed_optim(saved, OptimConfig(name="adamw", lr=3e-4), where="x") == []
    now = OptimConfig(name="adamw", lr=1e-4, clip_grad=1.0, total_steps=500)
    assert check_resumed_optim(saved, now, where="x") == [
        "lr 0.0003 -> 0.0001",
        "clip_grad 0.0 -> 1.0",
    ]
    assert check_resumed_optim(None, now, where="x") == []  # a checkpoint that does not say


def test_resume_from_a_folder_without_checkpoints(tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    argv = ["train", "--nproc", "2", *MLP, "--resume", str(tmp_path / "empty")]
    _one_line(capsys, argv, "no complete checkpoint", "--resume auto")
