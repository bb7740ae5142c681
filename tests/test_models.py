"""The model zoo: structure, deterministic builds, shapes, static stats and the CLI."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dynpipe.cli import main
from dynpipe.errors import UserError
from dynpipe.models import ZOO, get_model
from dynpipe.models.stats import LayerStats, layer_stats

# Small configurations so every test builds real weights quickly.
SMALL = {
    "mlp": {"depth": 2, "width": 16, "in_features": 8},
    "vgg16": {"width_mult": 1 / 16},
    "resnet50": {"width_mult": 1 / 16, "image_size": 16},
    "gpt": {"depth": 2, "width": 32, "heads": 2, "seq_len": 16, "vocab": 64},
    "bert": {"depth": 2, "width": 32, "heads": 2, "seq_len": 16, "vocab": 64},
}
ZOO_NAMES = list(SMALL)


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: intra-op thread hand-offs cost more than they save on a shared machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _small(name: str, **extra) -> object:
    return get_model(name, **{**SMALL[name], **extra})


def _meta_params(model) -> int:
    return sum(
        p.numel()
        for i in range(len(model))
        for p in model.build_layer(i, device="meta").parameters()
    )


def test_zoo_registers_every_model() -> None:
    get_model("mlp")  # loads the zoo
    assert set(ZOO_NAMES) <= set(ZOO)


def test_importing_one_zoo_module_first_still_loads_the_rest() -> None:
    code = (
        "import dynpipe.models.gpt\n"
        "from dynpipe.models import ZOO, get_model\n"
        "get_model('vgg16', width_mult=0.1)\n"
        "print(sorted(ZOO))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert "'mlp'" in out.stdout and "'resnet50'" in out.stdout


def test_layer_names_follow_the_architecture() -> None:
    vgg = _small("vgg16")
    convs = [
        f"conv{b}_{j}" for b, n in ((1, 2), (2, 2), (3, 3), (4, 3), (5, 3)) for j in range(1, n + 1)
    ]
    assert vgg.layer_names == [*convs, "fc6", "fc7", "fc8"]
    resnet = _small("resnet50")
    blocks = [f"layer{s}_{b}" for s, n in ((1, 3), (2, 4), (3, 6), (4, 3)) for b in range(n)]
    assert resnet.layer_names == ["stem", *blocks, "head"]
    assert _small("gpt").layer_names == ["embed", "block00", "block01", "head"]
    assert _small("bert").layer_names == ["embed", "block00", "block01", "mlm_head"]


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_names_are_unique_and_independent_of_width(name: str) -> None:
    a = _small(name)
    assert len(set(a.layer_names)) == len(a)
    wide = get_model(
        name,
        **{
            **SMALL[name],
            **({"width_mult": 1 / 8} if "width_mult" in SMALL[name] else {"width": 64}),
        },
    )
    assert wide.layer_names == a.layer_names
    assert wide.fingerprint() == a.fingerprint()


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_per_layer_build_is_deterministic(name: str) -> None:
    a, b = _small(name, seed=5), _small(name, seed=5)
    sa, sb = a.build_sequential().state_dict(), b.build_sequential().state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # A rank that builds one layer alone gets the same weights as the whole model has.
    last = len(a) - 1
    alone = a.build_layer(last).state_dict()
    assert all(torch.equal(v, sa[f"{a.layer_names[last]}.{k}"]) for k, v in alone.items())
    other = _small(name, seed=6).build_sequential().state_dict()
    assert any(not torch.equal(sa[k], other[k]) for k in sa if sa[k].is_floating_point())


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_uninitialised_build_loads_to_the_same_layer(name: str) -> None:
    # A migrated layer is built without initialisation and loaded; it must then be the
    # initialised layer, computing the same outputs.
    model = _small(name)
    for i in range(len(model)):
        ref = model.build_layer(i)
        layer = model.build_layer(i, init=False)
        assert not any(t.is_meta for t in layer.state_dict().values())
        layer.load_state_dict(ref.state_dict())
        sa, sb = ref.state_dict(), layer.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_uninitialised_build_still_computes_nonpersistent_buffers() -> None:
    from dynpipe.models.base import LayeredModel, LayerSpec

    class Scaled(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    model = LayeredModel(
        name="scaled",
        layers=(LayerSpec("a", "linear", Scaled),),
        loss_fn=torch.nn.functional.mse_loss,
        input_spec=_small("mlp").input_spec,
    )
    layer = model.build_layer(0, init=False)
    assert torch.equal(layer.scale, torch.full((4,), 2.0))
    assert "scale" not in layer.state_dict()


def test_traced_shapes_are_cached_per_batch_size() -> None:
    model = _small("gpt")
    first = model.trace_shapes(3)
    first.append("caller's own list")  # callers get a copy, never the cache itself
    again = model.trace_shapes(3)
    assert again == first[:-1] and again is not first
    assert model.trace_shapes(5)[0][0][0] == 5


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_forward_loss_backward_and_traced_shapes(name: str) -> None:
    model = _small(name)
    torch.manual_seed(0)
    x, y = model.input_spec.example(2)
    net = model.build_sequential()
    shapes = model.trace_shapes(2)
    h = x
    for layer, (shape, dtype) in zip(net, shapes, strict=True):
        h = layer(h)
        assert tuple(h.shape) == shape and h.dtype == dtype
    loss = model.loss_fn(h, y)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in net.named_parameters() if p.grad is None]
    assert not missing


def test_gpt_is_causal_and_bert_is_bidirectional() -> None:
    for name, causal in (("gpt", True), ("bert", False)):
        model = _small(name)
        net = model.build_sequential().eval()
        x = torch.randint(0, 60, (1, 16), generator=torch.Generator().manual_seed(0))
        x2 = x.clone()
        x2[0, -1] = (x[0, -1] + 1) % 60
        with torch.no_grad():
            same_prefix = torch.allclose(net(x)[0, :-1], net(x2)[0, :-1])
        assert same_prefix == causal, name


def test_gpt_scales_residual_projections() -> None:
    model = get_model("gpt", depth=12, width=256, heads=4, seq_len=8)
    block = model.build_layer(1)
    resid = 0.02 / math.sqrt(2 * 12)
    assert block.attn.proj.weight.std().item() == pytest.approx(resid, rel=0.05)
    assert block.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_bert_loss_ignores_unmasked_positions() -> None:
    model = _small("bert")
    logits = torch.randn(2, 16, 64)
    y = torch.full((2, 16), -100)
    y[0, 3], y[1, 7] = 5, 9
    expected = torch.nn.functional.cross_entropy(logits[[0, 1], [3, 7]], torch.tensor([5, 9]))
    assert torch.allclose(model.loss_fn(logits, y), expected)


def test_full_size_models_match_the_reference_architectures() -> None:
    # Parameter counts of the published architectures (torchvision, GPT-2 small, BERT-base);
    # GPT/BERT here have untied output layers and no segment embeddings or pooler.
    assert _meta_params(get_model("vgg16", image_size=224, num_classes=1000)) == 138_357_544
    assert _meta_params(get_model("resnet50", image_size=224, num_classes=1000)) == 25_557_032
    gpt2 = get_model("gpt", vocab=50257, seq_len=1024)
    assert _meta_params(gpt2) == 124_439_808 + 50257 * 768
    bert_base = get_model("bert", vocab=30522, seq_len=512)
    heads = (768 * 768 + 768) + 2 * 768 + (768 * 30522 + 30522)  # transform, LN, decoder
    assert _meta_params(bert_base) == 109_482_240 - 2 * 768 - (768 * 768 + 768) + heads


def test_image_models_adapt_to_image_size() -> None:
    vgg = get_model("vgg16", image_size=224)
    shapes = vgg.trace_shapes(1)
    assert shapes[12][0] == (1, 512, 7, 7) and shapes[13][0] == (1, 4096)
    assert get_model("vgg16").trace_shapes(1)[13][0] == (1, 512)
    resnet = get_model("resnet50", image_size=224)
    assert resnet.trace_shapes(1)[0][0] == (1, 64, 56, 56)  # ImageNet stem: /4
    assert get_model("resnet50").trace_shapes(1)[0][0] == (1, 64, 32, 32)  # CIFAR stem


def test_resnet_blocks_carry_batchnorm_buffers() -> None:
    block = _small("resnet50").build_layer(1)
    buffers = dict(block.named_buffers())
    assert "bn1.running_mean" in buffers and "downsample.1.running_var" in buffers


@pytest.mark.parametrize(
    ("name", "config", "needle"),
    [
        ("vgg16", {"image_size": 48}, "multiple of 32"),
        ("gpt", {"width": 100, "heads": 3}, "not divisible"),
        ("resnet50", {"stem": "tiny"}, "stem"),
        ("nosuchmodel", {}, "choose one of"),
    ],
)
def test_bad_configs_raise_one_line_user_errors(name: str, config: dict, needle: str) -> None:
    with pytest.raises(UserError, match=needle) as info:
        get_model(name, **config)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_layer_stats_are_consistent_with_the_model(name: str) -> None:
    model = _small(name)
    stats = layer_stats(model, batch_size=2)
    assert [s.name for s in stats] == model.layer_names
    assert all(isinstance(s, LayerStats) for s in stats)
    net = model.build_sequential()
    assert sum(s.param_bytes for s in stats) == sum(
        p.numel() * p.element_size() for p in net.parameters()
    )
    assert sum(s.param_count for s in stats) == sum(p.numel() for p in net.parameters())
    assert sum(s.buffer_bytes for s in stats) == sum(
        b.numel() * b.element_size() for b in net.buffers()
    )
    for s, (shape, dtype) in zip(stats, model.trace_shapes(2), strict=True):
        assert s.out_shape == shape and s.out_dtype == dtype
        assert s.out_bytes == math.prod(shape) * dtype.itemsize
        if s.kind in ("conv", "linear", "bottleneck", "transformer"):
            assert s.fwd_flops > 0 and s.bwd_flops >= s.fwd_flops
        if s.index > 0:
            assert s.saved_bytes > 0
    assert stats[0].as_dict()["out_dtype"] == "float32"


def test_layer_stats_counts_linear_flops_exactly() -> None:
    model = get_model("mlp", depth=2, width=16, in_features=8, num_classes=4)
    b = 3
    inp, fc0, _, head = layer_stats(model, batch_size=b)
    assert fc0.fwd_flops == 2 * b * 16 * 16
    assert fc0.bwd_flops == 2 * fc0.fwd_flops  # input grad + weight grad
    assert inp.bwd_flops == inp.fwd_flops  # the data needs no gradient: weight grad only
    assert head.fwd_flops == 2 * b * 16 * 4
    half = layer_stats(model, batch_size=b, dtype=torch.bfloat16)
    assert half[1].param_bytes * 2 == fc0.param_bytes and half[1].out_dtype == torch.bfloat16


@pytest.mark.timing
def test_layer_stats_is_fast_for_gpt_base() -> None:
    model = get_model("gpt")
    layer_stats(get_model("mlp", depth=1), batch_size=1)  # one-time FlopCounterMode set-up
    t0 = time.perf_counter()
    stats = layer_stats(model, batch_size=8)
    assert time.perf_counter() - t0 < 5.0
    assert len(stats) == 14 and stats[1].param_count == 7_087_872


def test_user_sequential_is_seeded_and_identical_on_every_rank(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    before = torch.random.get_rng_state()
    rank0 = get_model("usermodel_tiny:tiny_sequential", seed=3)
    rank1 = get_model("usermodel_tiny:tiny_sequential", seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is untouched
    s0, s1 = rank0.build_sequential().state_dict(), rank1.build_sequential().state_dict()
    assert all(torch.equal(s0[k], s1[k]) for k in s0)
    other = get_model("usermodel_tiny:tiny_sequential", seed=4).build_sequential().state_dict()
    assert not torch.equal(s0["layer000.weight"], other["layer000.weight"])
    assert rank0.layer_names == ["layer000", "layer001", "layer002"]
    assert rank0.trace_shapes(2)[-1][0] == (2, 3)  # builds on meta too
    assert layer_stats(rank0, batch_size=2)[0].fwd_flops == 2 * 2 * 8 * 16


def test_user_factory_errors_are_user_errors(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with pytest.raises(UserError, match=r"package\.module:function"):
        get_model("usermodel_tiny:no_such_factory")


def test_models_cli_lists_the_zoo(capsys) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ZOO_NAMES:
        assert f"\n{name} " in out
    vgg_line = out.split("\nvgg16 ")[1].split("\n")[0]
    assert f"{_meta_params(get_model('vgg16')):,}" in vgg_line and "image_size=32" in vgg_line


def test_models_cli_shows_one_model(capsys) -> None:
    argv = "models --model gpt --set depth=2 --set width=64 --set heads=2 --batch-size 4"
    assert main(argv.split()) == 0
    out = capsys.readouterr().out
    assert "block01" in out and "4x256x64" in out and "fwd GFLOP" in out
    assert main(["models", "--model", "gpt", "--set", "depth=0"]) == 2
    assert "depth" in capsys.readouterr().err
    assert main(["models", "--model", "mlp", "--set", "bogus=1"]) == 2
