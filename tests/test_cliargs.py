"""Flags made from config dataclasses: ``dynpipe train`` and the replay tool take their
names, types, defaults and help from TrainConfig, OptimConfig and AdaptConfig."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from script_loader import load_script

from dynpipe.cli import build_parser, main
from dynpipe.cliargs import add_config_args, config_kwargs, field_help
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.cli import config_from_args
from dynpipe.runtime.config import TrainConfig
from dynpipe.runtime.optim import DEFAULT_LR, OptimConfig

ROOT = Path(__file__).parents[1]


def _help(capsys, monkeypatch, argv: list[str]) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _shown_default(text: str, flag: str) -> str:
    """The ``(default: X)`` ending the help of ``flag`` (its entry may span two lines)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (--[\w-]+)", line)
        if m:
            current = m.group(1)
            entries[current] = line
        elif current is not None and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    m = re.search(r"\(default: (.*)\)$", entries.get(flag, ""))
    assert m, f"{flag} shows no default: {entries.get(flag)!r}"
    return m.group(1)


def test_train_help_shows_the_dataclass_defaults(capsys, monkeypatch) -> None:
    text = _help(capsys, monkeypatch, ["train"])
    run, optim, adapt = TrainConfig(), TrainConfig().optim, TrainConfig().adapt
    assert _shown_default(text, "--steps") == str(run.steps)
    assert _shown_default(text, "--log-every") == str(run.log_every)
    # The learning rate's default is the optimizer's own.
    assert all(str(DEFAULT_LR[o]) in _shown_default(text, "--lr") for o in DEFAULT_LR)
    assert optim.lr == DEFAULT_LR[optim.name]
    assert _shown_default(text, "--optimizer") == optim.name
    assert _shown_default(text, "--betas") == str(optim.betas)
    assert _shown_default(text, "--adapt") == adapt.mode == "static"
    assert _shown_default(text, "--min-gain") == str(adapt.min_gain)
    assert _shown_default(text, "--horizon") == str(adapt.horizon_steps)
    assert "--no-timing" in text and "--no-progress" in text and "--bf16" in text


def test_train_without_flags_is_the_default_config() -> None:
    cfg = config_from_args(build_parser().parse_args(["train"]))
    default = TrainConfig()
    # The learning-rate decay ends with the run: total_steps follows --steps.
    assert cfg == dataclasses.replace(
        default, optim=dataclasses.replace(default.optim, total_steps=default.steps)
    )


def test_the_default_learning_rate_follows_the_optimizer() -> None:
    # An instance's resolved rate must not become the flag's default: --optimizer sgd
    # alone once trained at AdamW's 0.001.
    for name, lr in DEFAULT_LR.items():
        cfg = config_from_args(build_parser().parse_args(["train", "--optimizer", name]))
        assert (cfg.optim.name, cfg.optim.lr) == (name, lr)
    cfg = config_from_args(
        build_parser().parse_args(["train", "--optimizer", "sgd", "--lr", "0.2"])
    )
    assert cfg.optim.lr == 0.2


def test_every_config_field_has_a_train_flag_that_sets_it() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    dests = {a.dest for a in sub.choices["train"]._actions}
    for cls, skip in ((TrainConfig, {"model_args", "optim", "adapt"}), (AdaptConfig, set())):
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
        missing = [n for n in missing if f"{cls.__name__}.{n}" not in dests]
        assert not missing, (cls.__name__, missing)
    args = build_parser().parse_args(
        [
            *("train", "--warmup", "7", "--lr-schedule", "cosine", "--betas", "0.8", "0.9"),
            *("--adapt", "measured", "--horizon", "40", "--jump", "0.3", "--no-telemetry"),
            *("--microbatches", "2", "--model-arg", "depth=3"),
        ]
    )
    cfg = config_from_args(args)
    assert (cfg.optim.warmup_steps, cfg.optim.schedule, cfg.optim.betas) == (
        7,
        "cosine",
        (0.8, 0.9),
    )
    assert (cfg.adapt.mode, cfg.adapt.horizon_steps, cfg.adapt.jump) == ("measured", 40, 0.3)
    assert (cfg.telemetry, cfg.microbatches, cfg.model_args) == (False, 2, {"depth": 3})


def test_train_and_optim_fields_are_all_documented() -> None:
    for cls in (TrainConfig, OptimConfig):
        undocumented = [name for name, text in field_help(cls).items() if not text]
        assert not undocumented, (cls.__name__, undocumented)


@dataclass(frozen=True)
class _Toy:
    """A config as another engineer might write it.

    rate: how fast,
        in units per step.
    count / width: two fields, one entry.
    """

    rate: float = 0.5
    count: int = 3
    width: int | None = None
    mode: str = field(default="a", metadata={"choices": ("a", "b"), "help": "which way (50%)"})
    on: bool = True
    off: bool = False
    pair: tuple[int, int] = (1, 2)


def test_flags_follow_whatever_fields_the_dataclass_has() -> None:
    p = argparse.ArgumentParser()
    added = add_config_args(p, _Toy, flags={"count": "--n"}, defaults=_Toy(rate=0.25))
    assert added == ["--rate", "--n", "--width", "--mode", "--no-on", "--off", "--pair"]
    assert config_kwargs(p.parse_args([]), _Toy) == dataclasses.asdict(_Toy(rate=0.25))
    got = config_kwargs(
        p.parse_args(
            ["--n", "4", "--width", "9", "--mode", "b", "--no-on", "--off", "--pair", "5", "6"]
        ),
        _Toy,
    )
    assert _Toy(**got) == _Toy(
        rate=0.25, count=4, width=9, mode="b", on=False, off=True, pair=(5, 6)
    )
    helps = {a.option_strings[0]: a.help for a in p._actions if a.option_strings}
    assert helps["--rate"] == "how fast, in units per step (default: %(default)s)"
    assert helps["--width"] == "two fields, one entry"
    assert helps["--mode"].startswith("which way (50%%)")
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "c"])


def test_unset_flags_tell_what_was_given() -> None:
    p = argparse.ArgumentParser()
    add_config_args(p, _Toy, unset=True)
    assert config_kwargs(p.parse_args(["--rate", "2"]), _Toy) == {
        "rate": 2.0,
        "count": None,
        "width": None,
        "mode": None,
        "on": None,
        "off": None,
        "pair": None,
    }


def test_unknown_names_and_types_without_a_flag_form_are_refused() -> None:
    with pytest.raises(ValueError, match="no fields"):
        add_config_args(argparse.ArgumentParser(), _Toy, flags={"speed": "--speed"})

    @dataclass
    class Nested:
        inner: _Toy = field(default_factory=_Toy)

    with pytest.raises(TypeError, match="exclude it"):
        add_config_args(argparse.ArgumentParser(), Nested)
    assert add_config_args(argparse.ArgumentParser(), Nested, exclude=("inner",)) == []


def test_replay_tool_takes_its_flags_from_adapt_config() -> None:
    replay = load_script("bench/replay_controller.py")
    args = replay.build_parser().parse_args(["x.jsonl", "--horizon", "3", "--jump", "0.2"])
    given = {k: v for k, v in config_kwargs(args, AdaptConfig).items() if v is not None}
    assert given == {"horizon_steps": 3, "jump": 0.2}
    fields = {f.name for f in dataclasses.fields(AdaptConfig)} - {"mode"}
    assert set(config_kwargs(args, AdaptConfig)) == fields


def test_a_broken_pipe_that_is_not_standard_output_is_not_hidden(monkeypatch) -> None:
    """Only a reader of stdout gone (`dynpipe ... | head`) exits quietly: a socket or pipe
    of a training peer that breaks must still fail loudly."""
    import dynpipe.cli as cli

    def broken(argv):
        raise BrokenPipeError("a peer's socket")

    monkeypatch.setattr(cli, "_dispatch", broken)
    with pytest.raises(BrokenPipeError):
        main([])
