"""Hugging Face models pipelined over 2 and 3 gloo ranks train exactly as one process does.

Tiny GPT-2 (tied embedding and LM head), Llama (tie_word_embeddings) and BERT (tied MLM
decoder) are saved into the test's folder by ``save_pretrained``, loaded with
``--model hf:PATH`` semantics, and trained with AdamW and clipping. Each run repartitions
once mid-way so one owner of the tied weight moves; the 3-rank run also resumes from a
checkpoint the 2-rank run wrote. Every run must equal the unsplit reference bit for bit
(parameters, optimizer state, losses), and the tied copies must be bit-identical on every
step.
"""

from __future__ import annotations

import pytest
import torch
from distutil import run_ranks
from hfutil import SEQ, save_tiny
from test_runtime_equivalence import BATCH, make_batch, optim_config

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ARCHS = ("gpt2", "llama", "bert")
STEPS, MOVE_AT, SAVE_AT = 6, 3, 2


def _plans(model, world: int):
    from dynpipe.planner import Plan

    n = len(model)  # 5 layers: embed, 3 blocks, head
    if world == 2:
        # Embedding and head on two ranks, then both on rank 1 (the tie becomes local).
        return Plan.from_bounds(model, [1, n - 1]), Plan.from_bounds(model, [n], ranks=[1])
    # Three owners' ranks, then the embedding's owner moves from rank 0 to rank 1.
    return Plan.from_bounds(model, [1, 2, n - 3]), Plan.from_bounds(model, [3, n - 3], ranks=[1, 2])


def _tied_sums(eng) -> list[float]:
    out = []
    for group in eng.model.ties:
        held = [eng.named_params[n] for n in group if n in eng.named_params]
        out.append([float(p.detach().double().sum()) for p in held])
    return out


def _train(rank: int, world: int, folders: dict, ckpt: str, resume: str | None) -> dict:
    from dynpipe.models import get_model
    from dynpipe.models.cut import cut_model_meta
    from dynpipe.runtime.checkpoint import load_checkpoint
    from dynpipe.runtime.checkpointer import save_checkpoint
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.migrate import repartition
    from dynpipe.runtime.optim import import_state
    from dynpipe.runtime.topology import Topology

    results = {}
    for arch, folder in folders.items():
        model = get_model(f"hf:{folder}", seq_len=SEQ)
        first, second = _plans(model, world)
        eng = PipelineEngine(
            model,
            first,
            topo=Topology.from_env(device="cpu"),
            config=EngineConfig(batch_size=BATCH, optim=optim_config("adamw")),
        )
        start = 0
        if resume is not None:
            state, meta = load_checkpoint(
                f"{resume}/{arch}",
                model_state=eng.model_state(),
                held_params=set(eng.named_params),
                rank=rank,
            )
            import_state(eng.optimizer, eng.named_params, state)
            start = meta["step"]
        losses, tied = [], []
        for s in range(start, STEPS):
            if s == MOVE_AT:
                repartition(eng, second)
            losses.append(eng.step(s, make_batch(model, s)).loss)
            tied.append(_tied_sums(eng))
            if s + 1 == SAVE_AT and resume is None:
                save_checkpoint(
                    f"{ckpt}/{arch}",
                    model_state=eng.model_state(),
                    optim_state=eng.optim_state(),
                    meta={
                        "step": SAVE_AT,
                        "model": model.name,
                        "model_fingerprint": model.fingerprint(),
                        **cut_model_meta(model),
                    },
                    rank=rank,
                )
        results[arch] = {
            "model": eng.model_state(),
            "optim": eng.optim_state(),
            "losses": losses,
            "tied": tied,
            "ties": model.ties,
        }
    return results


def _reference(folder) -> tuple[dict, dict, list[float]]:
    from dynpipe.models import get_model
    from dynpipe.runtime.reference import ReferenceTrainer

    model = get_model(f"hf:{folder}", seq_len=SEQ)
    ref = ReferenceTrainer(
        model=model, batch_size=BATCH, microbatches=4, optim=optim_config("adamw")
    )
    losses = [ref.step(s, make_batch(model, s)) for s in range(STEPS)]
    return ref.model_state(), ref.optim_state(), losses


def _check_run(results: list[dict], refs: dict, start: int) -> None:
    for arch, (want_m, want_o, want_losses) in refs.items():
        model, optim = {}, {}
        for r in results:
            model.update(r["value"][arch]["model"])
            optim.update(r["value"][arch]["optim"])
        assert set(model) == set(want_m) and set(optim) == set(want_o), arch
        for k in want_m:
            assert torch.equal(model[k], want_m[k]), f"{arch}: {k}"
        for k in want_o:
            assert torch.equal(optim[k], want_o[k]), f"{arch}: {k}"
        last = results[-1]["value"][arch]
        assert last["losses"] == want_losses[start:], arch
        ties = results[0]["value"][arch]["ties"]
        assert ties, f"{arch} has a tied embedding"
        for group in ties:
            assert torch.equal(model[group[0]], model[group[1]]), f"{arch}: {group}"
        # Every step, every rank's copies of each tie summed to the same value.
        for s in range(len(last["losses"])):
            for t in range(len(ties)):
                seen = {v for r in results for v in r["value"][arch]["tied"][s][t]}
                assert len(seen) == 1, f"{arch} step {s + start}: tied copies differ: {seen}"


def test_hf_pipelines_equal_reference_through_moves_and_resume(tmp_path) -> None:
    torch.set_num_threads(1)
    folders = {a: str(save_tiny(a, tmp_path)) for a in ARCHS}
    refs = {a: _reference(f) for a, f in folders.items()}
    ckpt = str(tmp_path / "ckpt")
    two = run_ranks(_train, 2, folders, ckpt, None, timeout_s=600)
    _check_run(two, refs, 0)
    three = run_ranks(_train, 3, folders, ckpt, None, timeout_s=600)
    _check_run(three, refs, 0)
    resumed = run_ranks(_train, 3, folders, str(tmp_path / "unused"), ckpt, timeout_s=600)
    _check_run(resumed, refs, SAVE_AT)
    _check_exports(folders, ckpt, tmp_path)


def _check_exports(folders: dict, ckpt: str, tmp_path) -> None:
    """The 2-rank run's checkpoint, exported, loads with from_pretrained and computes the
    logits of the layered model at that step (the reference after SAVE_AT steps, which
    the pipelined run equals bit for bit)."""
    import transformers

    from dynpipe.cli import main
    from dynpipe.models import get_model
    from dynpipe.models.export import main_class
    from dynpipe.runtime.reference import ReferenceTrainer

    for arch, folder in folders.items():
        out = tmp_path / f"export-{arch}"
        assert main(["export", "--checkpoint", f"{ckpt}/{arch}", "--to", "hf", str(out)]) == 0
        model = get_model(f"hf:{folder}", seq_len=SEQ)
        ref = ReferenceTrainer(
            model=model, batch_size=BATCH, microbatches=4, optim=optim_config("adamw")
        )
        for s in range(SAVE_AT):
            ref.step(s, make_batch(model, s))
        auto = getattr(transformers, main_class(model))
        hf = auto.from_pretrained(str(out))
        x, _ = make_batch(model, 99)
        with torch.no_grad():
            assert torch.equal(hf(x).logits, ref.forward(x)), arch


def _replicated(rank: int, world: int, folder: str) -> dict:
    import dataclasses

    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.mesh import init_mesh
    from dynpipe.runtime.topology import Topology

    model = get_model(f"hf:{folder}", seq_len=SEQ)
    plan = dataclasses.replace(Plan.from_bounds(model, [1, len(model) - 1], microbatches=2), dp=2)
    topo = Topology.from_env(device="cpu")
    eng = PipelineEngine(
        model,
        plan,
        topo=topo,
        mesh=init_mesh(topo, dp=2),
        config=EngineConfig(batch_size=BATCH, optim=optim_config("adamw")),
    )
    losses = [eng.step(s, make_batch(model, s)).loss for s in range(4)]
    return {"replica": eng.mesh.replica, "model": eng.model_state(), "losses": losses}


def test_tied_copies_with_two_replicas(tmp_path) -> None:
    """2 replicas x 2 stages: DDP averages each copy across replicas, then the stages of
    each replica sum the copies; equal to the reference adding in the replicas' grouping."""
    from dynpipe.models import get_model
    from dynpipe.runtime.reference import ReferenceTrainer

    torch.set_num_threads(1)
    folder = str(save_tiny("gpt2", tmp_path))
    results = run_ranks(_replicated, 4, folder, timeout_s=600)
    model = get_model(f"hf:{folder}", seq_len=SEQ)
    ref = ReferenceTrainer(
        model=model, batch_size=BATCH, microbatches=4, optim=optim_config("adamw"), groups=(2, 2)
    )
    want = [ref.step(s, make_batch(model, s)) for s in range(4)]
    want_m = ref.model_state()
    for replica in (0, 1):
        got = {}
        for r in results:
            if r["value"]["replica"] == replica:
                got.update(r["value"]["model"])
        assert set(got) == set(want_m)
        for k, v in want_m.items():
            assert torch.equal(got[k], v), f"replica {replica}: {k}"
        assert torch.equal(got["embed.wte.weight"], got["head.lm_head.weight"])
    assert results[-1]["value"]["losses"] == want


def _many_steps(rank: int, world: int, folder: str, steps: int) -> dict:
    from dynpipe.models import get_model
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.migrate import repartition
    from dynpipe.runtime.topology import Topology

    model = get_model(f"hf:{folder}", seq_len=SEQ)
    n = len(model)
    plans = [
        Plan.from_bounds(model, [1, n - 1]),
        Plan.from_bounds(model, [n - 1, 1]),
        Plan.from_bounds(model, [n], ranks=[0]),  # both copies on rank 0
        Plan.from_bounds(model, [2, n - 2]),
    ]
    eng = PipelineEngine(
        model,
        plans[0],
        topo=Topology.from_env(device="cpu"),
        config=EngineConfig(batch_size=BATCH, optim=optim_config("adamw")),
    )
    tied = []
    for s in range(steps):
        if s and s % 10 == 0:
            repartition(eng, plans[(s // 10) % len(plans)])
        eng.step(s, make_batch(model, s))
        tied.append(_tied_sums(eng))
    return {"tied": tied, "model": eng.model_state()}


def test_tied_copies_stay_identical_over_many_steps_and_moves(tmp_path) -> None:
    torch.set_num_threads(1)
    folder = str(save_tiny("gpt2", tmp_path))
    steps = 40
    results = run_ranks(_many_steps, 2, folder, steps, timeout_s=600)
    for s in range(steps):
        seen = {v for r in results for v in r["value"]["tied"][s][0]}
        assert len(seen) == 1, f"step {s}: tied copies differ: {seen}"
    state = {**results[0]["value"]["model"], **results[1]["value"]["model"]}
    assert torch.equal(state["embed.wte.weight"], state["head.lm_head.weight"])
