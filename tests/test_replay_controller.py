"""The replay tool's ``--explain``: the model behind one recorded decision, on a committed
GPU log (resnet50 at 128 images a microbatch, 2 x H200), read on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.script_loader import load_script

LOG = Path("analysis/logs/oracle-h200x2-781191c/resnet50-b1024-copy-s0/adaptive.jsonl.gz")


def _tool():
    return load_script("bench/replay_controller.py")


@pytest.mark.slow
def test_explain_prices_the_plans_behind_a_decision() -> None:
    tool = _tool()
    out = tool.replay(LOG, {"mode": "measured"}, None, explain=10, plans=["4|14"])
    assert "explain" in out[-1], out[-1]
    e = out[-1]["explain"]
    splits = [p["split"] for p in e["plans"]]
    assert splits[0] == "9|9" and "4|14" in splits and len(set(splits)) == len(splits)
    for p in e["plans"]:
        # A stage costs the longer of its device's sum and its host's.
        for cost, dev, host in zip(p["stage_ms"], p["device_ms"], p["host_ms"], strict=True):
            assert cost == pytest.approx(max(dev, host), abs=0.02)
    assert len(e["fwd_ms"]) == 2 and len(e["fwd_ms"][0]) == len(e["layers"]) == 18
    assert e["plans"][0]["step_ms"] > 0


def test_a_plan_that_does_not_cover_the_model_is_one_clear_line() -> None:
    with pytest.raises(SystemExit, match=r"--plan 4\|13: 17 layers.*sum to 18"):
        _tool()._bounds("4|13", 18)
    assert _tool()._bounds("4|14", 18) == ((0, 4), (4, 18))


def test_a_split_that_is_not_numbers_is_one_clear_line() -> None:
    with pytest.raises(SystemExit, match=r"--plan 4\|x: .*sum to 18"):
        _tool()._bounds("4|x", 18)
