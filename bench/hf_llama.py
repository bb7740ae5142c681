"""A ~1B-parameter Llama (``--model hf:llama``) on one GPU: profile, plans, and dynpipe's
one-process training speed against a plain Hugging Face training loop.

1. ``dynpipe profile`` of the model's layers on this device, clean only (a sweep of the
   ``none`` condition: no interferers, to keep it short), bf16, at the microbatch size.
2. ``dynpipe plan`` from that profile for 2 and 4 GPUs (the splits and predicted step times).
3. Tokens/s of one-process dynpipe training (``PipelineEngine`` holding all layers, one stage)
   against a plain loop over ``LlamaForCausalLM`` as a Hugging Face user writes it: the same
   weights (HF's init under one seed), batch, microbatches (gradient accumulation), bf16
   autocast and AdamW; both eager. The two alternate in blocks of steps so drift hits both.

Everything is printed side by side and written as JSON to ``-o``:

    python bench/hf_llama.py --device cuda -o $OUT/hf_llama.json       # ~1B, H100: ~4 min
    python bench/hf_llama.py --device cpu --tiny -o /tmp/hf_llama.json  # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
SEED = 0


def _cli(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path[1:]])}
    print("$ dynpipe " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "dynpipe", *args], check=True, env=env)


def _sets(conf: dict, seq: int) -> list[str]:
    return [w for k, v in {**conf, "seq_len": seq}.items() for w in ("--set", f"{k}={v}")]


def profile_and_plan(conf: dict, *, seq: int, mb: int, device: str, out: Path) -> dict:
    sweep = out / "none.toml"
    sweep.write_text('[sweep]\nname = "none"\nwarmup = 3\nrepeats = 5\nsample_ms = 30\n')
    parquet = out / "hf_llama_profile.parquet"
    dtype = ["--dtype", "bfloat16"] if device.startswith("cuda") else []
    dev = "cuda:0" if device.startswith("cuda") else "cpu"
    t0 = time.time()
    _cli(["profile", "--model", "hf:llama", *_sets(conf, seq), "--batch-size", str(mb),
          "--sweep", str(sweep), "--device", dev, *dtype, "--quiet", "-o", str(parquet)])  # fmt: skip
    profile_s = time.time() - t0
    plans = {}
    for gpus in (2, 4):
        path = out / f"hf_llama_plan_{gpus}.json"
        bf16 = ["--bf16"] if device.startswith("cuda") else []
        _cli(["plan", "--model", "hf:llama", *_sets(conf, seq), "--stages", str(gpus),
              "--batch-size", str(mb * 4), "--microbatches", "4", "--profile", str(parquet),
              *bf16, "-o", str(path)])  # fmt: skip
        plan = json.loads(path.read_text())
        plans[gpus] = {
            "layers_per_stage": [st["stop"] - st["start"] for st in plan["stages"]],
            "stage_fwd_bwd_ms": [
                round((st.get("fwd_ms") or 0) + (st.get("bwd_ms") or 0), 2) for st in plan["stages"]
            ],
            "meta": plan.get("meta", {}),
        }
    return {"profile_s": round(profile_s, 1), "profile": str(parquet), "plans": plans}


def _init_one_rank() -> None:
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip


def _batches(vocab: int, seq: int, batch: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def bench_training(conf: dict, *, seq: int, batch: int, mb: int, device: str, blocks: int,
                   steps: int) -> dict:  # fmt: skip
    from dynpipe.models import get_model
    from dynpipe.models.gpt import lm_cross_entropy
    from dynpipe.models.hf import hf_classes, hf_config
    from dynpipe.planner import Plan
    from dynpipe.runtime.engine import EngineConfig, PipelineEngine
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.topology import Topology, init_distributed

    cuda = device.startswith("cuda")
    _init_one_rank()
    topo = Topology.from_env(device="cuda" if cuda else "cpu")
    init_distributed(topo)
    dev = topo.device
    micro = batch // mb
    data = [(x.to(dev), y.to(dev)) for x, y in _batches(conf["vocab_size"], seq, batch, 4)]
    tokens = batch * seq

    model = get_model("hf:llama", seq_len=seq, seed=SEED, **conf)
    nparams = sum(
        p.numel()
        for i in range(len(model))
        for p in model.build_layer(i, device="meta").parameters()
    )
    engine = PipelineEngine(
        model,
        Plan.from_bounds(model, [len(model)], microbatches=micro),
        topo=topo,
        config=EngineConfig(batch_size=batch, optim=OptimConfig(name="adamw", lr=1e-4), bf16=cuda),
    )

    _, cls, _ = hf_classes("llama")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        hf = cls(hf_config("llama", **conf)).float().to(dev).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4)

    def hf_step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                logits = hf(input_ids=xm).logits
            loss = lm_cross_entropy(logits.float(), ym)
            (loss / micro).backward()
            total += float(loss.detach()) if not cuda else 0.0
        opt.step()
        return total

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    step_no = {"dynpipe": 0}

    def run(kind: str) -> float:
        sync()
        t0 = time.perf_counter()
        for i in range(steps):
            x, y = data[i % len(data)]
            if kind == "dynpipe":
                engine.step(step_no["dynpipe"], (x, y))
                step_no["dynpipe"] += 1
            else:
                hf_step(x, y)
        sync()
        return (time.perf_counter() - t0) / steps

    for kind in ("dynpipe", "hf"):  # warm-up: allocator, kernels, optimizer state
        run(kind)
    times: dict[str, list[float]] = {"dynpipe": [], "hf": []}
    for b in range(blocks):
        for kind in ("dynpipe", "hf") if b % 2 == 0 else ("hf", "dynpipe"):
            times[kind].append(run(kind))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "params": nparams,
        "batch": batch,
        "microbatches": micro,
        "seq_len": seq,
        "steps_per_block": steps,
        "blocks": blocks,
        "step_s": {k: [round(t, 4) for t in v] for k, v in times.items()},
        "tokens_per_s": {k: round(tokens / t, 1) for k, t in med.items()},
        "dynpipe_over_hf": round(med["hf"] / med["dynpipe"], 3),
    }
    if cuda:
        out["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--tiny", action="store_true", help="a 4-layer, 64-wide model (smoke run)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--blocks", type=int, default=6, help="alternating timed blocks per system")
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--skip-profile", action="store_true")
    p.add_argument("-o", "--out", default="hf_llama.json")
    args = p.parse_args(argv)
    conf = TINY if args.tiny else LLAMA_1B
    seq = min(args.seq_len, conf["max_position_embeddings"])
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"model": "hf:llama", "config": conf}
    if args.device.startswith("cuda"):
        result["device"] = torch.cuda.get_device_name(0)
    result["torch"] = torch.__version__
    import transformers

    result["transformers"] = transformers.__version__
    t0 = time.time()
    if not args.skip_profile:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(os.environ.get("OUT", tmp))
            result.update(profile_and_plan(conf, seq=seq, mb=args.microbatch_size,
                                           device=args.device, out=work))  # fmt: skip
    result["training"] = bench_training(
        conf, seq=seq, batch=args.batch_size, mb=args.microbatch_size, device=args.device,
        blocks=args.blocks, steps=args.steps,
    )  # fmt: skip
    result["wall_s"] = round(time.time() - t0, 1)
    out_path.write_text(json.dumps(result, indent=1))
    tr = result["training"]
    print(f"\nhf:llama {tr['params'] / 1e9:.2f}B params, batch {tr['batch']} x {tr['seq_len']} "
          f"tokens in {tr['microbatches']} microbatches, {result.get('device', args.device)}")  # fmt: skip
    print(f"{'system':<10}{'tokens/s':>12}{'step ms (median)':>20}")
    for k in ("dynpipe", "hf"):
        print(f"{k:<10}{tr['tokens_per_s'][k]:>12.0f}"
              f"{1e3 * statistics.median(tr['step_s'][k]):>20.1f}")  # fmt: skip
    print(f"dynpipe / plain HF throughput: {tr['dynpipe_over_hf']:.3f}")
    for gpus, plan in result.get("plans", {}).items():
        print(f"plan for {gpus} GPUs: layers per stage {plan['layers_per_stage']}, "
              f"stage fwd+bwd ms {plan['stage_fwd_bwd_ms']}")  # fmt: skip
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
