"""Data sources: determinism by step, epochs, shapes per model, learnability, clear errors."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from dynpipe.data import BatchSource, get_data
from dynpipe.data.masking import IGNORE_INDEX, mask_tokens
from dynpipe.data.vision import CIFAR10_MEAN, CIFAR10_STD, normalize, random_crop_flip
from dynpipe.errors import UserError
from dynpipe.models import get_model

TINY = {
    "mlp": {"depth": 2, "width": 32, "in_features": 12, "num_classes": 5},
    "vgg16": {"width_mult": 1 / 16},
    "resnet50": {"width_mult": 1 / 16, "image_size": 16},
    "gpt": {"depth": 1, "width": 32, "heads": 2, "seq_len": 16, "vocab": 64},
    "bert": {"depth": 1, "width": 32, "heads": 2, "seq_len": 16, "vocab": 64},
}


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: intra-op thread hand-offs cost more than they save on a shared machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _equal(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    return path


# -- synthetic ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TINY))
def test_synthetic_batches_fit_every_zoo_model(name: str) -> None:
    model = get_model(name, **TINY[name])
    spec = model.input_spec
    src = get_data("synthetic", model=model, seed=1)
    assert isinstance(src, BatchSource) and src.num_samples is None
    x, y = src.batch(0, 3)
    assert x.shape == (3, *spec.shape) and x.dtype == spec.dtype and x.device.type == "cpu"
    assert y.shape == (3, *spec.target_shape) and y.dtype == spec.target_dtype
    if spec.vocab is not None:
        assert int(x.min()) >= 0 and int(x.max()) < spec.vocab
    if name == "bert":
        assert ((y == IGNORE_INDEX) | ((y >= 0) & (y < spec.vocab - 1))).all()
        assert (y != IGNORE_INDEX).any(dim=1).all()  # every row has a masked position
    elif spec.num_classes is not None:
        assert int(y.min()) >= 0 and int(y.max()) < spec.num_classes
    with torch.no_grad():
        assert torch.isfinite(model.loss_fn(model.build_sequential()(x), y))


def test_synthetic_is_a_pure_function_of_seed_step_and_batch_size() -> None:
    model = get_model("mlp", **TINY["mlp"])
    rank0 = get_data("synthetic", model=model, seed=3)
    rank1 = get_data("synthetic", model=model, seed=3)
    torch.manual_seed(123)  # the global RNG must not matter
    a = rank0.batch(7, 4)
    torch.manual_seed(456)
    assert _equal(a, rank1.batch(7, 4))
    assert _equal(a, rank0.batch(7, 4))  # asking again (a replayed step) gives the same batch
    assert not _equal(a, rank0.batch(8, 4))
    assert not _equal(a, get_data("synthetic", model=model, seed=4).batch(7, 4))


def test_synthetic_tokens_follow_a_rule_with_little_noise() -> None:
    model = get_model("gpt", **TINY["gpt"])
    x, y = get_data("synthetic", model=model).batch(0, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    # A fixed next-token map explains almost every transition.
    pairs = torch.stack([x.flatten(), y.flatten()], dim=1)
    best = {}
    for prev, nxt in pairs.tolist():
        best.setdefault(prev, []).append(nxt)
    agree = sum(max(v.count(n) for n in set(v)) for v in best.values())
    assert agree / len(pairs) > 0.85


def _train(model_name: str, config: dict, *, steps: int, lr: float, batch_size: int) -> list[float]:
    model = get_model(model_name, **config)
    src = get_data("synthetic", model=model)
    net = model.build_sequential()
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = src.batch(step, batch_size)
        loss = model.loss_fn(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    ("name", "config", "lr"),
    [
        ("mlp", {}, 3e-3),  # the default 8-deep mlp
        ("gpt", {"depth": 2, "width": 64, "heads": 2, "seq_len": 32}, 3e-3),
    ],
)
def test_synthetic_data_is_learnable(name: str, config: dict, lr: float) -> None:
    losses = _train(name, config, steps=50, lr=lr, batch_size=32 if name == "mlp" else 16)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (first, last)


def test_synthetic_without_a_model_explains_itself() -> None:
    src = get_data("synthetic")
    assert src.model_kwargs("gpt") == {}
    with pytest.raises(UserError, match="model=model"):
        src.batch(0, 2)


# -- masking -------------------------------------------------------------------------------


def test_mask_tokens_masks_about_fifteen_percent_and_always_one() -> None:
    tokens = torch.randint(0, 99, (400, 20), generator=torch.Generator().manual_seed(0))
    x, y = mask_tokens(tokens, vocab=100, gen=torch.Generator().manual_seed(1))
    chosen = y != IGNORE_INDEX
    assert 0.12 < chosen.float().mean().item() < 0.19
    assert chosen.any(dim=1).all()
    assert torch.equal(y[chosen], tokens[chosen])
    assert torch.equal(x[~chosen], tokens[~chosen])
    masked = (x == 99) & chosen
    assert 0.7 < masked.sum().item() / chosen.sum().item() < 0.9
    one = torch.zeros(5, 1, dtype=torch.long)
    assert (mask_tokens(one, vocab=10, gen=torch.Generator())[1] == 0).all()


# -- digits ----------------------------------------------------------------------------------


def test_digits_epochs_are_seeded_permutations_that_steps_cross() -> None:
    src = get_data("digits", seed=2)
    test = get_data("digits", split="test")
    n = src.num_samples
    assert n + test.num_samples == 1797  # scikit-learn's bundled set, split 80/20
    ids = torch.cat([src.indices(s, 100) for s in range(2 * n // 100 + 1)])
    epoch0, epoch1 = ids[:n], ids[n : 2 * n]
    assert torch.equal(epoch0.sort().values, torch.arange(n))
    assert torch.equal(epoch1.sort().values, torch.arange(n))
    assert not torch.equal(epoch0, epoch1)
    # A batch straddling the epoch boundary is the end of one permutation and the start of
    # the next; the data position is step * batch_size whatever the batch size.
    step = n // 100
    assert torch.equal(
        src.indices(step, 100), torch.cat([epoch0[step * 100 :], epoch1[: (step + 1) * 100 - n]])
    )
    x, y = src.batch(3, 8)
    assert x.shape == (8, 64) and y.shape == (8,) and x.dtype == torch.float32
    assert _equal((x, y), get_data("digits", seed=2).batch(3, 8))
    assert not torch.equal(src.indices(0, 50), get_data("digits", seed=3).indices(0, 50))


def test_digits_are_standardised_and_fit_the_mlp() -> None:
    src = get_data("digits")
    x, _ = src.batch(0, src.num_samples)
    assert x.mean().abs().item() < 1e-4
    kwargs = src.model_kwargs("mlp")
    assert kwargs == {"in_features": 64, "num_classes": 10}
    model = get_model("mlp", depth=1, **kwargs)
    assert get_data("digits", model=model).num_samples == src.num_samples
    with pytest.raises(UserError, match=r"shape \(64,\).*in_features"):
        get_data("digits", model=get_model("mlp", in_features=32))
    with pytest.raises(UserError, match="use --model mlp or vgg16 or resnet50"):
        src.model_kwargs("gpt")
    assert src.model_kwargs("my_factory") == {}  # a user model: its fit is checked later


# -- text ------------------------------------------------------------------------------------


def test_text_windows_give_next_byte_targets(text_file) -> None:
    model = get_model("gpt", **{**TINY["gpt"], "vocab": 256})
    src = get_data("text", model=model, path=str(text_file))
    data = text_file.read_bytes()
    cut = len(data) - len(data) // 10  # the last tenth is held out
    assert src.num_samples == (cut - 17) // 16 + 1
    x, y = src.batch(0, 4)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    for i, row in zip(src.indices(0, 4).tolist(), x, strict=True):
        assert bytes(row.tolist()) == data[i * 16 : i * 16 + 16]
    assert _equal((x, y), get_data("text", model=model, path=str(text_file)).batch(0, 4))
    assert src.model_kwargs("gpt") == {"vocab": 256}
    # The held-out windows lie in the last tenth, none crossing the cut.
    test = get_data("text", model=model, path=str(text_file), split="test")
    assert test.num_samples == (len(data) - cut - 17) // 16 + 1
    xt, _ = test.batch(0, 3)
    for i, row in zip(test.indices(0, 3).tolist(), xt, strict=True):
        assert bytes(row.tolist()) == data[cut + i * 16 : cut + i * 16 + 16]


def test_text_for_bert_is_masked(text_file) -> None:
    model = get_model("bert", **{**TINY["bert"], "vocab": 256})
    src = get_data("text", model=model, path=str(text_file), seed=1)
    x, y = src.batch(2, 8)
    assert x.shape == y.shape == (8, 16)
    assert (x == 255).any() and (y != IGNORE_INDEX).any(dim=1).all()
    assert _equal((x, y), get_data("text", model=model, path=str(text_file), seed=1).batch(2, 8))
    assert not _equal((x, y), src.batch(3, 8))


def test_text_errors_name_the_numbers(text_file, tmp_path) -> None:
    with pytest.raises(UserError, match="not a file"):
        get_data("text", path=str(tmp_path / "missing.txt"))
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(UserError, match=r"3 bytes.* needs 17"):
        get_data("text", path=str(short), seq_len=16)
    # 160 bytes hold windows for training, but their held-out tenth (16 bytes) holds none.
    short.write_text("x" * 160)
    assert get_data("text", path=str(short), seq_len=16).num_samples == 8
    with pytest.raises(UserError, match=r"test split of .* has 16 bytes but one window .* 17"):
        get_data("text", path=str(short), seq_len=16, split="test")
    with pytest.raises(UserError, match="vocab=256"):
        get_data("text", path=str(text_file), model=get_model("gpt", **TINY["gpt"]))
    with pytest.raises(UserError, match="use --model gpt or bert"):
        get_data("text", path=str(text_file)).model_kwargs("resnet50")


def test_a_probe_cuts_windows_of_the_seq_len_the_model_will_have(tmp_path) -> None:
    # 201 bytes: 181 to train on, too few for the default seq_len (256), plenty for 32.
    short = tmp_path / "t2.txt"
    short.write_bytes(b"x" * 201)
    probe = get_data("text", path=str(short), model_args={"seq_len": 32, "depth": 2})
    assert probe.seq_len == 32 and probe.num_samples == (181 - 33) // 32 + 1
    assert get_data("text", path=str(short), model_args={}, seq_len=16).seq_len == 16
    # A value the model will refuse is left to the model to name.
    with pytest.raises(UserError, match="seq_len=256 needs 257"):
        get_data("text", path=str(short), model_args={"seq_len": "abc"})


def test_train_builds_text_data_at_the_model_arg_seq_len(tmp_path) -> None:
    from dynpipe.runtime.config import TrainConfig
    from dynpipe.runtime.train import build_model_and_data

    short = tmp_path / "t2.txt"
    short.write_bytes(b"x" * 201)
    args = {"depth": 1, "width": 32, "heads": 2, "seq_len": 32}
    cfg = TrainConfig(model="gpt", model_args=args, data="text", data_path=str(short))
    model, data = build_model_and_data(cfg)
    assert model.input_spec.shape == (32,) and data.sample_shape == (32,)


@pytest.mark.parametrize(
    ("name", "needle"),
    [("text", "FILE"), ("cifar10", "DIR (a folder holding"), ("imagefolder", "DIR (one sub")],
)
def test_a_source_read_from_disk_without_a_path_names_the_flag(name: str, needle: str) -> None:
    with pytest.raises(UserError) as info:
        get_data(name)
    assert str(info.value).startswith(f"--data {name} needs --data-path {needle}")
    assert "\n" not in str(info.value) and "None" not in str(info.value)


# -- images ----------------------------------------------------------------------------------


def test_random_crop_flip_picks_windows_of_the_padded_image() -> None:
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).view(2, 3, 6, 6)
    out = random_crop_flip(x, gen=torch.Generator().manual_seed(0), padding=2, flip=False)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for b in range(2):
        windows = [padded[b, :, i : i + 6, j : j + 6] for i in range(5) for j in range(5)]
        assert any(torch.equal(out[b], w) for w in windows)
    same = random_crop_flip(x, gen=torch.Generator().manual_seed(0), padding=2, flip=False)
    assert torch.equal(out, same)
    assert torch.equal(random_crop_flip(x, gen=torch.Generator(), padding=0, flip=False), x)
    flipped = random_crop_flip(
        x.repeat(16, 1, 1, 1), gen=torch.Generator().manual_seed(1), padding=0
    )
    kinds = {
        torch.equal(f, x[i % 2]) or (torch.equal(f, x[i % 2].flip(-1)) and 2)
        for i, f in enumerate(flipped)
    }
    assert kinds == {True, 2}  # some flipped, some not, nothing else
    mean, std = (0.5, 0.25, 0.0), (0.5, 0.5, 1.0)
    assert torch.allclose(
        normalize(torch.full((1, 3, 2, 2), 0.5), mean, std)[0, :, 0, 0],
        torch.tensor([0.0, 0.5, 0.5]),
    )


def test_cifar10_missing_folder_is_a_one_line_error(tmp_path) -> None:
    with pytest.raises(UserError, match="cifar-10-batches-py"):
        get_data("cifar10")
    with pytest.raises(UserError, match=r"nothing is downloaded") as info:
        get_data("cifar10", path=str(tmp_path))
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def _fake_cifar(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for f in (
        "data_batch_1",
        "data_batch_2",
        "data_batch_3",
        "data_batch_4",
        "data_batch_5",
        "test_batch",
        "batches.meta",
    ):
        (folder / f).write_bytes(b"not a pickle")
    return folder


def test_cifar10_without_torchvision_says_how_to_install_it(tmp_path, monkeypatch) -> None:
    folder = _fake_cifar(tmp_path)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # makes `import torchvision` fail
    with pytest.raises(UserError, match=r"pip install 'dynpipe\[vision\]'"):
        get_data("cifar10", path=str(folder))  # naming the inner folder works too
    with pytest.raises(UserError, match=r"pip install 'dynpipe\[vision\]'"):
        get_data("imagefolder", path=str(tmp_path))


def _stand_in_torchvision(monkeypatch, n: int) -> tuple[np.ndarray, list[int]]:
    # torchvision's CIFAR10 as documented (``data``: N x 32 x 32 x 3 uint8, ``targets``: list
    # of ints), so the reading, normalisation and augmentation here run without it.
    data = np.random.default_rng(0).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    targets = [i % 10 for i in range(n)]

    class CIFAR10:
        def __init__(self, root: str, train: bool = True, download: bool = False) -> None:
            assert not download
            self.data, self.targets = (data, targets) if train else (data[:10], targets[:10])

    tv = types.ModuleType("torchvision")
    tv.datasets = types.SimpleNamespace(CIFAR10=CIFAR10)
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    return data, targets


def test_cifar10_batches_are_normalised_augmented_and_resized(tmp_path, monkeypatch) -> None:
    data, targets = _stand_in_torchvision(monkeypatch, 30)
    _fake_cifar(tmp_path)
    plain = get_data("cifar10", path=str(tmp_path), augment=False)
    assert plain.num_samples == 30 and plain.model_kwargs("vgg16") == {
        "image_size": 32,
        "num_classes": 10,
    }
    x, y = plain.batch(1, 8)
    ids = plain.indices(1, 8)
    raw = torch.from_numpy(data[ids.numpy()]).permute(0, 3, 1, 2).float() / 255
    assert torch.allclose(x, normalize(raw, CIFAR10_MEAN, CIFAR10_STD))
    assert y.tolist() == [targets[i] for i in ids.tolist()]
    aug = get_data("cifar10", path=str(tmp_path), seed=0)  # the train split augments
    xa, ya = aug.batch(1, 8)
    assert torch.equal(ya, y) and not torch.equal(xa, x)
    assert _equal((xa, ya), get_data("cifar10", path=str(tmp_path), seed=0).batch(1, 8))
    big = get_model("vgg16", image_size=64, width_mult=1 / 16)
    assert get_data("cifar10", path=str(tmp_path), model=big).batch(0, 2)[0].shape == (2, 3, 64, 64)
    assert get_data("cifar10", path=str(tmp_path), split="test").num_samples == 10
    few = get_model("resnet50", width_mult=1 / 16, num_classes=5)
    with pytest.raises(UserError, match=r"10 classes .* num_classes=10"):
        get_data("cifar10", path=str(tmp_path), model=few)


def test_cifar10_corrupt_folder_is_a_user_error(tmp_path) -> None:
    pytest.importorskip("torchvision")
    _fake_cifar(tmp_path)
    with pytest.raises(UserError, match="unreadable"):
        get_data("cifar10", path=str(tmp_path))


def test_imagefolder_reads_resizes_and_is_deterministic(tmp_path) -> None:
    pytest.importorskip("torchvision")
    from PIL import Image

    for c, colour in enumerate(("red", "blue")):
        (tmp_path / f"class{c}").mkdir()
        for i in range(3):
            Image.new("RGB", (40 + i, 30), colour).save(tmp_path / f"class{c}" / f"{i}.png")
    model = get_model("resnet50", width_mult=1 / 16, image_size=32, num_classes=2)
    src = get_data("imagefolder", model=model, path=str(tmp_path), augment=True)
    held = get_data("imagefolder", model=model, path=str(tmp_path), split="test", augment=True)
    # Without train/ and val/ folders, a fixed tenth (at least one image) is held out.
    assert held.num_samples == 1 and not held.augment
    train_ids, test_ids = set(src._ids.tolist()), set(held._ids.tolist())
    assert not train_ids & test_ids and len(train_ids | test_ids) == 6
    assert src.num_samples == 5 and src.model_kwargs("resnet50") == {
        "image_size": 32,
        "num_classes": 2,
    }
    x, y = src.batch(1, 4)
    assert x.shape == (4, 3, 32, 32) and set(y.tolist()) <= {0, 1}
    assert _equal(
        (x, y), get_data("imagefolder", model=model, path=str(tmp_path), augment=True).batch(1, 4)
    )


def test_imagefolder_missing_folder_is_a_user_error(tmp_path) -> None:
    with pytest.raises(UserError, match="one sub-folder of images per class"):
        get_data("imagefolder", path=str(tmp_path / "nope"))


# -- get_data --------------------------------------------------------------------------------


def test_get_data_rejects_unknown_names_options_and_paths(tmp_path) -> None:
    with pytest.raises(UserError, match="choose one of synthetic, digits"):
        get_data("mnist")
    with pytest.raises(UserError, match="no option bogus; its options are image_size, augment"):
        get_data("digits", bogus=1)
    with pytest.raises(UserError, match=r"splits train, test \(test: held out\); got split='val'"):
        get_data("digits", split="val")
    with pytest.raises(UserError, match="not read from disk"):
        get_data("digits", path=str(tmp_path))
    with pytest.raises(UserError, match="step >= 0"):
        get_data("digits").batch(-1, 4)


# -- held-out splits -------------------------------------------------------------------------


def test_synthetic_test_split_is_other_samples_of_the_same_task() -> None:
    model = get_model("mlp", **TINY["mlp"])
    train = get_data("synthetic", model=model, seed=5)
    test = get_data("synthetic", model=model, seed=5, split="test")
    assert test.split == "test" and test.num_samples is None
    a, b = train.batch(3, 64), test.batch(3, 64)
    assert not torch.equal(a[0], b[0])
    assert _equal(b, get_data("synthetic", model=model, seed=5, split="test").batch(3, 64))
    # Same distribution: one teacher labels both splits, so a classifier fit on the training
    # samples' prototypes labels held-out samples as well as training ones.
    protos = train._prototypes(5, 12)
    for x, y in (a, b):
        assert torch.equal(torch.cdist(x, protos).argmin(dim=1) % 5, y)


def test_digits_and_cifar_test_splits_are_their_own_held_out_sets(tmp_path, monkeypatch) -> None:
    train, test = get_data("digits"), get_data("digits", split="test")
    rows = {tuple(r.tolist()) for r in train.batch(0, train.num_samples)[0]}
    held = test.batch(0, test.num_samples)[0]
    assert sum(tuple(r.tolist()) in rows for r in held) < 0.05 * len(held)  # a few duplicates
    assert _equal(test.batch(2, 16), get_data("digits", split="test").batch(2, 16))
    _stand_in_torchvision(monkeypatch, 30)
    _fake_cifar(tmp_path)
    ctest = get_data("cifar10", path=str(tmp_path), split="test")
    assert ctest.num_samples == 10 and not ctest.augment


def test_imagefolder_reads_train_and_val_folders(tmp_path) -> None:
    pytest.importorskip("torchvision")
    from PIL import Image

    for split, n in (("train", 4), ("val", 2)):
        for c in ("cat", "dog"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (20, 20), "red").save(tmp_path / split / c / f"{i}.png")
    assert get_data("imagefolder", path=str(tmp_path), image_size=16).num_samples == 8
    test = get_data("imagefolder", path=str(tmp_path), image_size=16, split="test")
    assert test.num_samples == 4 and test.num_classes == 2
    (tmp_path / "val" / "emu").mkdir()
    Image.new("RGB", (20, 20), "red").save(tmp_path / "val" / "emu" / "0.png")
    with pytest.raises(UserError, match="same class folders"):
        get_data("imagefolder", path=str(tmp_path), image_size=16, split="test")


def _fake_stdlib(root) -> dict[str, bytes]:
    files = {
        "abc.py": b"import os\n" * 30,
        "json/__init__.py": b"def loads(s):\n    return s\n" * 20,
        "json/decoder.py": b"class Decoder:\n    pass\n" * 25,
        "zipfile.py": b"# zip\n" * 40,
        "test/test_abc.py": b"skipped: the test suite is not library source\n",
        "site-packages/pkg/mod.py": b"skipped: third-party\n",
        "README.txt": b"skipped: not .py\n",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_pystdlib_gathers_library_sources_in_sorted_order_split_by_file(tmp_path) -> None:
    from dynpipe.data.text import PyStdlibSource, _held_out, stdlib_files

    files = _fake_stdlib(tmp_path)
    found = [p.relative_to(tmp_path).as_posix() for p in stdlib_files(tmp_path)]
    assert found == ["abc.py", "json/__init__.py", "json/decoder.py", "zipfile.py"]
    src = PyStdlibSource(root=str(tmp_path), seq_len=8, split="train")
    kept = [f for f in found if not _held_out(f)]
    assert bytes(src._bytes) == b"".join(files[f] + b"\n" for f in kept)
    assert src.files == len(kept) and str(src.files) in src.describe()
    again = PyStdlibSource(root=str(tmp_path), seq_len=8)
    assert _equal(src.batch(4, 6), again.batch(4, 6)) and src.digest == again.digest


def test_pystdlib_of_this_python_trains_gpt_with_a_held_out_tenth() -> None:
    import pickle
    import sysconfig
    from pathlib import Path

    from dynpipe.data.text import _held_out, stdlib_files

    model = get_model("gpt", **{**TINY["gpt"], "vocab": 256})
    assert get_data("pystdlib").model_kwargs("gpt") == {"vocab": 256}
    train = get_data("pystdlib", model=model)
    test = get_data("pystdlib", model=model, split="test")
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [p.relative_to(root).as_posix() for p in stdlib_files(root)]
    held = [r for r in rels if _held_out(r)]
    assert train.files + test.files == len(rels) > 100 and test.files == len(held)
    assert 0.05 < len(held) / len(rels) < 0.15
    x, y = test.batch(0, 4)
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert bytes(x[0].tolist()) in bytes(test._bytes)
    # Loader workers rebuild the corpus rather than receive it.
    assert len(pickle.dumps(train)) < 100_000
    assert _equal(pickle.loads(pickle.dumps(train)).batch(9, 4), train.batch(9, 4))
    with pytest.raises(UserError, match="not read from disk"):
        get_data("pystdlib", path="somewhere")


def test_digits_held_out_pixels_stay_on_a_sane_scale() -> None:
    # Pixels constant in the training split must not blow up held-out images that use them.
    test = get_data("digits", split="test")
    x, _ = test.batch(0, test.num_samples)
    assert float(x.abs().max()) < 100
