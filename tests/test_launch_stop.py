"""The launcher's line after a stop names the checkpoint the workers stopped on, also when
the stop fell on a step a periodic save had just written (no second save of that step)."""

from __future__ import annotations

import json
import time

import torch

from dynpipe.runtime.checkpointer import save_checkpoint
from dynpipe.runtime.launch import _final_checkpoint


def _save(root, step: int, reason: str):
    meta = {"step": step, "reason": reason}
    return save_checkpoint(root, model_state={"w": torch.ones(2)}, optim_state={}, meta=meta)


def test_a_stop_on_a_periodic_save_names_that_save(tmp_path) -> None:
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    started = time.time()
    path = _save(ck, 12, "periodic")
    old = {"type": "event", "time": started - 100, "event": "stopped", "step": 4, "checkpoint": "x"}
    new = {"type": "event", "time": time.time(), "event": "stopped", "step": 12}
    log.write_text(
        json.dumps(old) + "\n" + json.dumps({**new, "checkpoint": str(path)}) + '\n{"type": "ev'
    )
    got = _final_checkpoint(ck, "run", log=log, since=started)
    assert got == f"final checkpoint {path} (step 12)"


def test_without_a_stopped_event_the_newest_checkpoint_decides(tmp_path) -> None:
    ck = tmp_path / "ck"
    path = _save(ck, 12, "periodic")
    got = _final_checkpoint(ck, None, log=tmp_path / "none.jsonl")
    assert got == f"no final checkpoint; the newest is {path} (step 12)"
    stop = _save(ck, 13, "stop:SIGTERM")
    assert _final_checkpoint(ck, None) == f"final checkpoint {stop} (step 13)"
    assert _final_checkpoint(None, None) == "no checkpoint written (no --save-dir)"
