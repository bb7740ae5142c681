"""The prefetching batch stream: the same batches as direct calls for any worker count, in
step order; workers stop when it closes; a failing or stalled source is a clear error."""

from __future__ import annotations

import time

import psutil
import pytest
import torch
from distutil import run_ranks

from dynpipe.cli import build_parser
from dynpipe.data import get_data
from dynpipe.data.loader import BatchStream
from dynpipe.errors import UserError
from dynpipe.models import get_model
from dynpipe.runtime.cli import config_from_args
from dynpipe.runtime.config import TrainConfig

TINY_VGG = {"width_mult": 1 / 16, "image_size": 32}
TINY_GPT = {"depth": 1, "width": 32, "heads": 2, "seq_len": 16, "vocab": 64}


class _Broken:
    """Fails at step 2 (top level: workers unpickle sources by reference)."""

    name = "broken"
    num_samples = None

    def __init__(self, error: type[Exception] = ValueError) -> None:
        self.error = error

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 2:
            raise self.error("no sample 2 here\nsecond line")
        return torch.full((batch_size, 2), float(step)), torch.zeros(batch_size)

    def __repr__(self) -> str:
        return "Broken()"


class _Stalled(_Broken):
    """Hangs at step 1, as a worker stuck on a dead network mount would."""

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 1:
            time.sleep(60)
        return torch.zeros(batch_size, 2), torch.zeros(batch_size)


class _Unpicklable(_Broken):
    def __init__(self) -> None:
        super().__init__()
        self.hook = lambda: None  # a lambda cannot be pickled to the workers


def _source(kind: str, tmp_path):
    if kind == "image":
        return get_data("synthetic", model=get_model("vgg16", **TINY_VGG), seed=3)
    if kind == "tokens":
        return get_data("synthetic", model=get_model("gpt", **TINY_GPT), seed=3)
    if kind == "digits":
        return get_data("digits", seed=3)
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    return get_data("text", path=str(path), seq_len=16, seed=3)


def _workers() -> set[int]:
    # Workers are forked by the fork server, a child of this process: look two levels down.
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["image", "tokens", "digits", "text"])
def test_stream_gives_exactly_the_direct_batches_in_order(kind, workers, tmp_path) -> None:
    src = _source(kind, tmp_path)
    rng = torch.get_rng_state()
    # digits: 1437 samples, so steps 42..46 of 32 cross from epoch 0 into epoch 1.
    with BatchStream(src, batch_size=32, start=42, stop=47, workers=workers) as stream:
        got = list(stream)
    # Starting workers must not draw from the global RNG: training would depend on them.
    assert torch.equal(rng, torch.get_rng_state())
    assert [s for s, _ in got] == list(range(42, 47))
    for step, (x, y) in got:
        want_x, want_y = src.batch(step, 32)
        assert torch.equal(x, want_x) and torch.equal(y, want_y), step
        assert x.dtype == want_x.dtype and y.dtype == want_y.dtype


def test_stream_refuses_a_step_out_of_order() -> None:
    with BatchStream(_Broken(), batch_size=4, start=5, stop=8, workers=0) as stream:
        stream.batch(5)
        with pytest.raises(RuntimeError, match="asked for step 7; a stream gives each step once"):
            stream.batch(7)
        stream.batch(6)
    with pytest.raises(RuntimeError, match="asked for step 7"):
        stream.batch(7)  # closed
    with pytest.raises(UserError, match="data workers must be >= 0, got -1"):
        BatchStream(_Broken(), batch_size=4, start=0, stop=3, workers=-1)


def test_closing_early_stops_every_worker() -> None:
    with BatchStream(_Broken(), batch_size=4, start=0, stop=2, workers=1) as warm:
        list(warm)  # the fork server starts once per process and stays: count it out
    before = _workers()
    stream = BatchStream(_Broken(), batch_size=4, start=10, stop=1000, workers=2)
    assert torch.equal(stream.batch(10)[0], torch.full((4, 2), 10.0))
    started = _workers() - before
    assert len(started) == 2, started
    stream.close()
    alive = [p for p in started if psutil.pid_exists(p) and psutil.Process(p).is_running()]
    assert not alive, alive
    # Reaching the last step stops the workers too, without a close().
    stream = BatchStream(_Broken(), batch_size=4, start=0, stop=2, workers=2)
    stream.batch(0), stream.batch(1)
    assert _workers() == before


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_source_names_the_step_in_one_line(workers) -> None:
    stream = BatchStream(_Broken(), batch_size=4, start=0, stop=5, workers=workers)
    stream.batch(0), stream.batch(1)
    with pytest.raises(ValueError if workers == 0 else RuntimeError) as info:
        stream.batch(2)
    msg = str(info.value)
    assert "no sample 2 here" in msg
    if workers:
        assert len(msg.splitlines()) == 1, msg
        assert "Broken().batch(step=2, batch_size=4) raised ValueError" in msg
        # The worker's traceback is attached, pointing at the line that raised.
        assert "raise self.error" in str(info.value.__cause__)
    stream.close()


def test_a_user_error_in_a_worker_stays_a_one_line_user_error() -> None:
    stream = BatchStream(_Broken(UserError), batch_size=4, start=2, stop=5, workers=1)
    with pytest.raises(UserError, match=r"^no sample 2 here \(loading step 2\)$"):
        stream.batch(2)
    assert stream.next_step == 2 and stream._it is None  # a failure closes the stream


@pytest.mark.filterwarnings("ignore:Got pickle error")  # torch's own hint, beside ours
def test_an_unpicklable_source_says_so() -> None:
    with pytest.raises(RuntimeError) as info:
        BatchStream(_Unpicklable(), batch_size=4, start=0, stop=3, workers=1)
    msg = str(info.value)
    assert msg.startswith("cannot start data workers for Broken(): Can't pickle"), msg
    assert "--data-workers 0" in msg and len(msg.splitlines()) == 1


@pytest.mark.timing
def test_a_stalled_worker_times_out_instead_of_hanging() -> None:
    with BatchStream(_Broken(), batch_size=4, start=0, stop=2, workers=1) as warm:
        list(warm)  # the fork server starts once per process and stays: count it out
    before = _workers()
    stream = BatchStream(_Stalled(), batch_size=4, start=0, stop=3, workers=1, timeout_s=2.0)
    stream.batch(0)  # the worker is up; the next step is where it hangs
    (worker,) = _workers() - before
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        stream.batch(1)
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and "no batch for step 1 after 2s" in msg, msg
    assert "--data-workers 0" in msg and "--timeout" in msg
    # Two seconds of timeout, then up to five for the stuck worker to be joined, then killed.
    assert time.monotonic() - t0 < 15
    assert not psutil.pid_exists(worker) or not psutil.Process(worker).is_running()


def test_data_workers_option_is_validated_and_reaches_the_config(capsys) -> None:
    from dynpipe.cli import main

    args = build_parser().parse_args(["train", "--data-workers", "3"])
    assert config_from_args(args).data_workers == 3
    assert config_from_args(build_parser().parse_args(["train"])).data_workers is None
    assert main(["train", "--data-workers", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--data-workers must be >= 0, got -1" in err[0], err
    with pytest.raises(UserError, match="--data-workers must be >= 0"):
        TrainConfig(data_workers=-2)


def _train_losses(rank: int, world: int, workers: int) -> dict:
    import os

    from dynpipe.runtime.topology import Topology
    from dynpipe.runtime.train import train

    seen: list[int] = []

    def count_loaders(engine, res) -> None:
        if res.step == 3:
            seen.append(len(_workers()))

    cfg = TrainConfig(
        model="mlp",
        steps=6,
        batch_size=16,
        microbatches=2,
        data_workers=workers,
        progress=False,
        telemetry=False,
        log=os.devnull,
    )
    out = train(cfg, topo=Topology.from_env(device="cpu"), on_step=count_loaders)
    return {"losses": out["losses"], "processes": seen[0]}


@pytest.mark.slow
def test_training_with_data_workers_is_bit_identical() -> None:
    direct = [r["value"] for r in run_ranks(_train_losses, 2, 0)]
    loaded = [r["value"] for r in run_ranks(_train_losses, 2, 2)]
    # Both ranks load (first and last stage): two workers each, beside the fork server.
    assert [r["processes"] for r in direct] == [0, 0]
    assert all(r["processes"] >= 3 for r in loaded), loaded
    assert direct[1]["losses"] == loaded[1]["losses"] == loaded[0]["losses"]


def test_device_batches_cycle_the_first_steps_batches_and_are_validated(capsys) -> None:
    from dynpipe.cli import main
    from dynpipe.data.loader import CyclicBatches

    model = get_model("mlp", depth=2, width=8, in_features=8, num_classes=4)
    src = get_data("synthetic", model=model)
    with CyclicBatches(src, batch_size=4, count=3, device="cpu") as batches:
        for step in (0, 1, 2, 3, 7):
            x, y = batches.batch(step)
            rx, ry = src.batch(step % 3, 4)
            assert torch.equal(x, rx) and torch.equal(y, ry)
        assert not torch.equal(batches.batch(1)[0], batches.batch(2)[0])
    with pytest.raises(RuntimeError, match="after it was closed"):
        batches.batch(0)
    with pytest.raises(UserError, match="device batches must be >= 1"):
        CyclicBatches(src, batch_size=4, count=0, device="cpu")
    args = build_parser().parse_args(["train", "--device-batches", "4"])
    assert config_from_args(args).device_batches == 4
    assert main(["train", "--device-batches", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device-batches must be >= 0" in err[0], err
