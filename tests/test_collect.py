"""The step collector: cyclic garbage is freed at the steps it names, on every rank alike,
and Python's collector is as it was after the run."""

from __future__ import annotations

import gc
import weakref

import pytest

from dynpipe.errors import UserError
from dynpipe.runtime.collect import StepCollector
from dynpipe.runtime.config import TrainConfig


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: reference counting alone never frees it


def _cycle() -> weakref.ref:
    return weakref.ref(_Node())


def test_cycles_are_freed_at_the_named_steps_and_not_between():
    assert gc.isenabled()
    c = StepCollector(3)
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        ref = _cycle()
        for _ in range(5000):  # far past the automatic collector's threshold
            _cycle()
        c.step(0)
        c.step(1)
        assert ref() is not None  # no collection between the named steps
        c.step(2)  # the third step: collected
        assert ref() is None
    finally:
        c.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    c.close()  # twice: nothing more
    assert gc.isenabled()


def test_zero_leaves_pythons_collector_alone():
    c = StepCollector(0)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    c.step(0)
    c.close()
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled_after_the_run():
    gc.disable()
    try:
        c = StepCollector(2)
        c.close()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_negative_gc_every_is_one_clear_line():
    with pytest.raises(UserError, match="--gc-every must be >= 0"):
        TrainConfig(model="mlp", gc_every=-1)
