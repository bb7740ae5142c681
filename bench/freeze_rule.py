"""``--freeze``'s rule against the rule it replaced and against no freezing, side by side.

One process, one thread, the unsplit model (``ReferenceTrainer``: what every pipelined run
equals, frozen layers included), a small gpt on ``pystdlib`` text with a fresh batch every
step, AdamW with warm-up and cosine decay, no clipping (as ``bench/gpu_elastic.sh``'s freeze
runs). Each rule runs live: at the end of every ``--every``-step window it reads the
window's per-layer RMS gradient norms and mean training loss and may grow the frozen prefix,
which is frozen before the next step exactly as ``--freeze`` does
(``ReferenceTrainer.freeze``). Printed per rule: the frozen prefix over time, the layer-steps
whose backward was skipped, the time spent in training steps (one thread; on a shared
machine a rough figure, the skipped layer-steps are exact), and the held-out accuracy and
loss (next-byte for the gpt). The JSON (``--out``) holds every run's windows and
evaluations, and where it ran.

Three settings:

- ``scratch``: trained from initialisation to the end of the schedule (``--steps``).
- ``finetune``: the ``scratch`` run without freezing, trained on for ``--ft-steps`` under
  a fresh, lower schedule (``--ft-lr``): the setting PipeTransformer's rule was made for.
- ``digits``: an mlp (6 x 64) on scikit-learn's digits for ``--digits-steps`` under the
  scratch schedule: a model that converges (training loss near 0 by step 700, held-out
  accuracy flat from step 600), where freezing should save work at no cost.

After each, ``replay``: each rule re-decided on that setting's unfrozen run's windows
with every window's numbers multiplied by ``1 + N(0, --noise)`` (draws of ``--draws``): the
spread of the first freeze's step says how much a decision hangs on noise.

    PYTHONPATH=$PWD python bench/freeze_rule.py --out bench/results/freeze_rule_cpu.json

The "old" rule is the one ``--freeze`` used before (kept here only, to compare): freeze the
leading layers whose gradient norm changed by less than the threshold since the last window.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dynpipe.data import BatchSource, get_data
from dynpipe.models import get_model
from dynpipe.models.base import LayeredModel
from dynpipe.runtime.freeze import FreezeHistory, FreezeRule, frozen_prefix
from dynpipe.runtime.optim import OptimConfig
from dynpipe.runtime.reference import ReferenceTrainer
from dynpipe.runtime.runlog import environment

# A rule: (window's mean loss, window's norms, frozen, step after the window) -> new frozen.
Rule = Callable[[float, np.ndarray, int, int], int]


def old_rule(rule: FreezeRule) -> Rule:
    """The previous rule: relative change of each layer's norm since the last window."""
    prev: list[np.ndarray | None] = [None]

    def decide(loss: float, now: np.ndarray, frozen: int, step: int) -> int:
        last, prev[0] = prev[0], now
        if last is None:
            return frozen
        n = len(now)
        most = min(n - 1, frozen + max(1, math.floor(rule.alpha * (n - frozen))))
        k = frozen
        while k < most:
            a, b = float(last[k]), float(now[k])
            if not (a == 0 and b == 0) and (a <= 0 or abs(b - a) / a >= rule.threshold):
                break
            k += 1
        return k

    return decide


def new_rule(rule: FreezeRule) -> Rule:
    """``--freeze``'s rule, through the runtime's own functions (``Freezer.check``'s steps)."""
    history = FreezeHistory()

    def decide(loss: float, now: np.ndarray, frozen: int, step: int) -> int:
        if not rule.counts(step - 1):
            return frozen
        history.add(loss=loss, norms=now, rule=rule)
        return frozen_prefix(history, frozen=frozen, rule=rule)

    return decide


def no_rule(loss: float, now: np.ndarray, frozen: int, step: int) -> int:
    return frozen


@dataclass
class Task:
    """A model, its training data and the held-out batches every evaluation reads."""

    model: LayeredModel
    data: BatchSource
    held: list


def gpt_task(a: argparse.Namespace) -> Task:
    probe = get_data("pystdlib", seed=a.seed)
    model = get_model(
        "gpt",
        **probe.model_kwargs("gpt"),
        depth=a.depth,
        width=a.width,
        heads=4,
        seq_len=a.seq_len,
        seed=a.seed,
    )
    test = get_data("pystdlib", model=model, seed=a.seed, split="test")
    held = [test.batch(b, a.batch) for b in range(a.eval_batches)]
    return Task(model, get_data("pystdlib", model=model, seed=a.seed), held)


def digits_task(a: argparse.Namespace) -> Task:
    """An mlp on scikit-learn's digits: a model that does converge in a few hundred steps
    (training loss near 0, held-out accuracy flat), on the whole held-out split."""
    probe = get_data("digits", seed=a.seed)
    model = get_model("mlp", **probe.model_kwargs("mlp"), depth=6, width=64, seed=a.seed)
    test = get_data("digits", model=model, seed=a.seed, split="test")
    held = [test.batch(b, a.batch) for b in range(test.num_samples // a.batch)]
    return Task(model, get_data("digits", model=model, seed=a.seed), held)


def train(
    a: argparse.Namespace,
    task: Task,
    *,
    decide: Rule,
    steps: int,
    optim: OptimConfig,
    start: int = 0,
    init: dict | None = None,
) -> dict:
    """Train ``steps`` steps (data from batch ``start``) under ``decide``; the record."""
    model, data, held = task.model, task.data, task.held
    t = ReferenceTrainer(model, batch_size=a.batch, microbatches=1, optim=optim)
    if init is not None:
        t.load(init, t.optim_state())
    names = list(t.layers)
    sq, losses, windows, evals, timeline = np.zeros(len(names)), [], [], [], []
    frozen, skipped = 0, 0
    wall = 0.0
    for s in range(steps):
        t0 = time.perf_counter()
        losses.append(t.step(s, data.batch(start + s, a.batch)))
        wall += time.perf_counter() - t0
        skipped += frozen
        for i, n in enumerate(names[frozen:], frozen):
            for p in t.layers[n].parameters():
                if p.grad is not None:
                    sq[i] += float(p.grad.double().pow(2).sum())
        if (s + 1) % a.every == 0:
            norms = np.sqrt(sq / a.every)
            loss = float(np.mean(losses[-a.every :]))
            windows.append({"step": s + 1, "loss": loss, "norms": norms.tolist()})
            sq[:] = 0
            if s + 1 < steps:
                k = decide(loss, norms, frozen, s + 1)
                if k > frozen:
                    t.freeze(k)
                    frozen = k
                    timeline.append((s + 1, k))
        if (s + 1) % a.eval_every == 0 or s + 1 == steps:
            ev = t.evaluate(held)
            evals.append({"step": s + 1, "acc": ev.accuracy, "loss": ev.loss})
    return {
        "timeline": timeline,
        "skipped_layer_steps": skipped,
        "layer_steps": steps * len(names),
        "train_s": wall,
        "evals": evals,
        "windows": windows,
        "state": t.model_state(),
    }


def replay(windows: list[dict], make: Callable[[], Rule], *, noise: float, draws: int) -> list:
    """The first freeze's step of a fresh rule on ``windows`` with multiplicative noise."""
    gen = np.random.default_rng(0)
    out = []
    for _ in range(draws):
        decide, first = make(), None
        for w in windows[:-1]:
            norms = np.asarray(w["norms"]) * (1 + noise * gen.standard_normal(len(w["norms"])))
            loss = w["loss"] * (1 + noise * gen.standard_normal())
            if decide(loss, norms, 0, w["step"]) > 0:
                first = w["step"]
                break
        out.append(first)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--ft-steps", type=int, default=400)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--threshold", type=float, default=0.05)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ft-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--noise", type=float, default=0.03)
    p.add_argument("--draws", type=int, default=200)
    p.add_argument("--digits-steps", type=int, default=1500)
    p.add_argument("--settings", default="scratch,finetune,digits")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)  # a shared machine: one core, and times comparable run to run
    gpt = gpt_task(a)

    def rule(warmup: int) -> FreezeRule:
        return FreezeRule(
            every=a.every,
            threshold=a.threshold,
            alpha=a.alpha,
            patience=a.patience,
            warmup=warmup,
        )

    settings = a.settings.split(",")
    makers = {"none": lambda r: no_rule, "old": old_rule, "new": new_rule}
    report: dict = {
        "where": {**environment(torch.device("cpu")), "threads": 1, "cpus": os.cpu_count()},
        "args": vars(a),
        "layers": gpt.model.layer_names,
    }
    scratch_opt = OptimConfig(
        name="adamw", lr=a.lr, warmup_steps=a.warmup, schedule="cosine", total_steps=a.steps
    )
    base_state = None
    for setting in settings:
        task = gpt
        if setting == "scratch":
            steps, opt, start, init = a.steps, scratch_opt, 0, None
        elif setting == "digits":
            task, steps, start, init = digits_task(a), a.digits_steps, 0, None
            opt = dataclasses.replace(scratch_opt, total_steps=steps)
        else:
            if base_state is None:
                base_state = train(a, gpt, decide=no_rule, steps=a.steps, optim=scratch_opt)[
                    "state"
                ]
            steps, start, init = a.ft_steps, a.steps, base_state
            opt = OptimConfig(
                name="adamw",
                lr=a.ft_lr,
                warmup_steps=a.warmup,
                schedule="cosine",
                total_steps=a.ft_steps,
            )
        print(f"== {setting}: {steps} steps, lr {opt.lr}, warm-up {opt.warmup_steps}", flush=True)
        runs = {}
        for name, make in makers.items():
            r = train(
                a,
                task,
                decide=make(rule(opt.warmup_steps)),
                steps=steps,
                optim=opt,
                start=start,
                init=init,
            )
            if setting == "scratch" and name == "none":
                base_state = r["state"]
            runs[name] = r
            last = r["evals"][-1]
            print(
                f"{name:>5}: held-out acc {last['acc']:.4f} loss {last['loss']:.4f} | "
                f"frozen {r['timeline'] or '-'} | backward skipped "
                f"{r['skipped_layer_steps'] / r['layer_steps']:.1%} of layer-steps | "
                f"train {r['train_s']:.0f} s",
                flush=True,
            )
        for r in runs.values():
            r.pop("state")
        report[setting] = runs
        for name in ("old", "new"):
            firsts = replay(
                runs["none"]["windows"],
                lambda n=name, w=opt.warmup_steps: makers[n](rule(w)),
                noise=a.noise,
                draws=a.draws,
            )
            never = sum(f is None for f in firsts)
            got = sorted(f for f in firsts if f is not None)
            q = (
                f"first freeze at step min {got[0]}, median {got[len(got) // 2]}, max {got[-1]}"
                if got
                else "no freeze"
            )
            print(
                f"replay {name:>3} (norms and loss x (1 + N(0, {a.noise}))): {q}; "
                f"no freeze in {never} of {a.draws}",
                flush=True,
            )
            report[setting][f"replay_{name}"] = firsts
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
