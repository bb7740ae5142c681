"""digits as images for conv models: shapes per model, a pure function of the step whatever
the batch size or worker count, augmentation on the training split only, and learnable."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dynpipe.data import get_data
from dynpipe.data.digits import DigitsImageSource, DigitsSource
from dynpipe.data.loader import BatchStream
from dynpipe.errors import UserError
from dynpipe.models import get_model

TINY_VGG = {"width_mult": 1 / 16, "image_size": 32}


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: intra-op thread hand-offs cost more than they save on a shared machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _raw(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits of ``split``, ink 0..16, and their labels, by split index."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    keep = order[359:] if split == "train" else order[:359]
    return torch.as_tensor(x, dtype=torch.float32).view(-1, 8, 8)[keep], torch.as_tensor(y)[keep]


def _centre(x: torch.Tensor) -> torch.Tensor:
    """Each image's centre of ink ``(row, col)`` in pixels; blank paper is the batch's least
    value (the images are standardised)."""
    ink = (x[:, 0] - x.amin()).clamp(min=0)
    rows = torch.arange(x.shape[-2], dtype=x.dtype)[:, None]
    cols = torch.arange(x.shape[-1], dtype=x.dtype)[None, :]
    mass = ink.sum(dim=(1, 2))
    return (
        torch.stack([(ink * rows).sum(dim=(1, 2)), (ink * cols).sum(dim=(1, 2))], 1) / mass[:, None]
    )


def _corr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of each pair of rows of ``a`` and ``b`` (flattened per sample)."""
    a, b = a.flatten(1), b.flatten(1)
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))


@pytest.mark.parametrize(
    ("name", "config", "side"),
    [
        ("vgg16", {"width_mult": 1 / 16}, 32),
        ("resnet50", {"width_mult": 1 / 16, "image_size": 16}, 16),
        ("resnet50", {"width_mult": 1 / 16, "image_size": 224}, 224),
        ("vgg16", {"width_mult": 1 / 16, "image_size": 224}, 224),
    ],
)
def test_a_conv_model_gets_images_at_its_own_size(name: str, config: dict, side: int) -> None:
    probe = get_data("digits")
    kwargs = probe.model_kwargs(name)
    assert kwargs == {"num_classes": 10}  # the image size stays the model's own
    model = get_model(name, **kwargs, **config)
    for split in ("train", "test"):
        src = get_data("digits", model=model, split=split)
        flat = get_data("digits", split=split)
        assert isinstance(src, DigitsImageSource) and src.num_samples == flat.num_samples
        x, y = src.batch(0, 4)
        assert x.shape == (4, 3, side, side) and x.dtype == torch.float32
        assert y.shape == (4,) and y.dtype == torch.long
        # The grey digit on every channel, labels those of the flat form, in the same order.
        assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 0], x[:, 2])
        assert torch.equal(src.indices(5, 8), flat.indices(5, 8))
        assert torch.equal(y, flat.batch(0, 4)[1])
    out = model.build_sequential()(x)
    assert out.shape == (4, 10)


def test_image_size_option_and_mismatches_are_one_line_errors() -> None:
    src = get_data("digits", image_size=24)
    assert src.sample_shape == (3, 24, 24) and src.augment
    assert src.model_kwargs("resnet50") == {"num_classes": 10, "image_size": 24}
    assert get_data("digits", image_size=(16, 40)).batch(0, 2)[0].shape == (2, 3, 16, 40)
    with pytest.raises(UserError, match=r"shape \(3, 24, 24\).*image_size': 24"):
        get_data("digits", model=get_model("vgg16", **TINY_VGG), image_size=24)
    with pytest.raises(UserError, match="use --model mlp or vgg16 or resnet50"):
        get_data("digits").model_kwargs("gpt")
    with pytest.raises(UserError, match="augmentation applies to images"):
        get_data("digits", augment=True)
    with pytest.raises(UserError, match="size >= 1"):
        get_data("digits", image_size=0)
    # The mlp keeps its 64 standardised features.
    assert isinstance(get_data("digits", model=get_model("mlp", in_features=64)), DigitsSource)


def test_a_batch_is_a_pure_function_of_seed_and_step_whatever_the_batch_size() -> None:
    src = get_data("digits", image_size=32, seed=4)
    x, y = src.batch(3, 16)
    again = get_data("digits", image_size=32, seed=4).batch(3, 16)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert not torch.equal(x, get_data("digits", image_size=32, seed=5).batch(3, 16)[0])
    # Each sample's augmentation is drawn from (seed, epoch, sample): the samples at data
    # positions 48..63 look the same in batches of 16 and of 32.
    assert torch.equal(src.batch(1, 32)[0][16:], x)
    # Sample by sample, a batch straddling the epoch boundary is the batches of one sample
    # at its positions: each side augmented for its own epoch.
    step = src.num_samples // 100
    alone = [src.batch(step * 100 + j, 1)[0] for j in range(100)]
    assert torch.equal(src.batch(step, 100)[0], torch.cat(alone))


def test_training_images_are_small_affine_moves_of_the_digit_and_held_out_ones_never() -> None:
    train = get_data("digits", image_size=32)
    plain = get_data("digits", image_size=32, augment=False)
    test = get_data("digits", image_size=32, split="test")
    n = train.num_samples
    ids = train.indices(0, 64)
    assert torch.equal(ids, plain.indices(0, 64))
    x, y = train.batch(0, 64)
    x0, y0 = plain.batch(0, 64)
    assert torch.equal(y, y0)
    # Every sample moved, by a small move: its ink's centre shifts by less than 2 pixels of
    # the 8x8 digit (up to 1 each way, plus what 12 degrees and 10% of scale do to a digit
    # whose ink sits off the centre), and the image still resembles the digit.
    assert (x - x0).abs().flatten(1).amax(1).min() > 0.1
    moved = (_centre(x) - _centre(x0)).norm(dim=1) * 8 / 32
    assert moved.max() < 2 and moved.max() > 0.5, moved
    assert _corr(x, x0).mean() > 0.6
    # The same training sample in the next epoch moves differently.
    pos = torch.nonzero(train.indices(1, n) == ids[0]).item()
    assert not torch.equal(train.batch(n + pos, 1)[0][0], x[0])

    # Held out: the same image for a sample in every epoch, whatever its position...
    m = test.num_samples
    e0, e1 = test.indices(0, m), test.indices(1, m)
    assert not torch.equal(e0, e1)  # a fresh order each epoch
    a, b = test.batch(0, m)[0], test.batch(1, m)[0]
    assert torch.equal(a[e0.argsort()], b[e1.argsort()])
    # ...and that image is the digit itself, upsampled: area-averaged back to 8x8 it matches
    # scikit-learn's pixels (the split is scikit-learn's digits, shuffled with seed 0, 20% out).
    raw, labels = _raw("test")
    assert torch.equal(test.batch(0, m)[1], labels[e0])
    back = F.interpolate(a[:, :1], size=(8, 8), mode="area")
    assert _corr(back, raw[e0]).min() > 0.95


def test_a_stream_gives_the_direct_batches_for_any_worker_count() -> None:
    src = get_data("digits", model=get_model("vgg16", **TINY_VGG), seed=3)
    torch.set_num_threads(2)  # the training process's threads against one per worker
    # Steps 44..45 of 32 cross from epoch 0 into epoch 1 (1438 training samples).
    want = [src.batch(step, 32) for step in range(43, 46)]
    for workers in (0, 2):
        with BatchStream(src, batch_size=32, start=43, stop=46, workers=workers) as stream:
            got = [b for _, b in stream]
        for (x, y), (wx, wy) in zip(got, want, strict=True):
            assert torch.equal(x, wx) and torch.equal(y, wy), workers


def test_a_small_conv_net_learns_the_digit_images() -> None:
    # A tiny vgg16 (4-32 channels) at 32x32: 300 steps of 32 augmented images (about 7
    # epochs), then the whole held-out split. Chance is 10%.
    torch.manual_seed(0)
    model = get_model("vgg16", **TINY_VGG)
    train = get_data("digits", model=model)
    test = get_data("digits", model=model, split="test")
    net = model.build_sequential()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for step in range(300):
        x, y = train.batch(step, 32)
        loss = model.loss_fn(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y = test.batch(0, test.num_samples)
    with torch.no_grad():
        accuracy = (net.eval()(x).argmax(dim=1) == y).float().mean().item()
    assert accuracy > 0.3, accuracy
