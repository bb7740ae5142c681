"""Diagnosis: what the engine's _probe reads for a gpt 12x2048 block on an idle GPU, with and
without the lead, against the block run back to back. Not part of the package."""
import sys, time, types
import numpy as np
import torch
import dynpipe.runtime.timing as T
from dynpipe.models import get_model
from dynpipe.runtime.engine import PipelineEngine
from dynpipe.runtime.timing import LayerProbe, StageTimer

dev = torch.device("cuda:0")
model = get_model("gpt", depth=12, width=2048, heads=16, seq_len=1024)
timer = StageTimer(device=dev)
fake = types.SimpleNamespace(
    topo=types.SimpleNamespace(device=dev, is_cuda=True),
    config=types.SimpleNamespace(batch_size=32, bf16=True),
    plan=types.SimpleNamespace(total_microbatches=8),
    model=model, timer=timer, _probe_copy=None, _probe_issue_ms=0.0,
)
probe = lambda **kw: PipelineEngine._probe(fake, 10, **kw)

def show(tag, got):
    print(f"{tag:34s} fwd {got.fwd_ms[0]:.3f} bwd {got.bwd_ms[0]:.3f} | host {got.launch_fwd_ms[0]:.3f} {got.launch_bwd_ms[0]:.3f} | dev {got.device_fwd_ms[0]:.3f} {got.device_bwd_ms[0]:.3f} issue {fake._probe_issue_ms:.2f}", flush=True)

for k in range(3):
    show(f"lead warm r3 #{k}", probe(repeats=3, warm=True))
for k in range(2):
    show(f"lead r1 #{k}", probe(repeats=1))
torch.cuda.empty_cache(); time.sleep(1.0)
show("lead warm r3 after idle 1s+empty", probe(repeats=3, warm=True))
orig = T.queue_ahead
import dynpipe.runtime.engine as E
E.queue_ahead = lambda d, ms: None
for k in range(2):
    show(f"no lead warm r3 #{k}", probe(repeats=3, warm=True))
E.queue_ahead = orig
# Each chunk's own readings (not the median): rerun with the probe's internals
lp = timer.layers
mod = fake._probe_copy[1]
shape, dtype = model.trace_shapes(4)[9]
x = torch.randn(shape, device=dev, requires_grad=True)
def once(chunk, timed=True):
    lp.sampling, lp.chunk, lp.chunks = timed, chunk, None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = lp.run([mod], x)
    lp.begin_backward(chunk)
    out.float().sum().backward()
    lp.end_backward(chunk)
for lead in (0.0, 30.0):
    once(0, False); torch.cuda.synchronize()
    T.queue_ahead(dev, lead)
    for c in range(5):
        once(c)
    torch.cuda.synchronize()
    fwd, bwd, edges = lp._fwd, lp._bwd, lp._bwd_edges
    rows = []
    for c in range(5):
        f = fwd[c][0][0].elapsed_time(fwd[c][1][0])
        b0, e = edges[c]
        hook = bwd[c].get(0)
        b = b0[0].elapsed_time(hook[0]) if hook else float('nan')
        be = b0[0].elapsed_time(e[0])
        rows.append((f, b, be, hook is not None))
    print("lead", lead, "per chunk (fwd, bwd to hook, bwd to end, hook?)", [tuple(round(v,3) if isinstance(v,float) else v for v in r) for r in rows], flush=True)
    lp.collect()
# back to back reference: 10 microbatches queued, whole-burst events
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
lp.sampling = False
T.queue_ahead(dev, 60.0); a.record()
for c in range(10):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = mod(x)
    out.float().sum().backward()
b.record(); b.synchronize()
print("back to back fwd+bwd per microbatch", a.elapsed_time(b) / 10)
# the forward alone back to back
with torch.no_grad():
    T.queue_ahead(dev, 30.0); a.record()
    for c in range(10):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = mod(x)
    b.record(); b.synchronize()
print("back to back fwd per microbatch", a.elapsed_time(b) / 10)
print("streams", torch.cuda.current_stream(), torch.cuda.default_stream())
