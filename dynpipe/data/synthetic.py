"""``synthetic``: an endless, learnable stream shaped to any model's input spec.

Learnable means the loss can fall well below chance, so a pipelined run shows real
training curves without a data set on disk:

- float inputs, class targets: inputs are drawn around fixed random prototypes (two per
  class) and a fixed teacher labels each with its nearest prototype's class. Image-shaped
  inputs (C, H, W) are smooth images upsampled from a 4x4 latent that holds the
  prototypes, so convolutional nets can learn them as well as MLPs can;
- float inputs, float targets: the target is a fixed random linear map (regression);
- token inputs, token targets: sequences follow ``next = (a * prev + b) mod V`` with a few
  random tokens (next-token prediction, or masked prediction for an MLM model);
- token inputs, class targets: the teacher acts on the bag of tokens.

The held-out split (``test``) draws its samples from generators of its own, with the same
prototypes, teacher and rule: different samples from the same distribution.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from dynpipe.data.base import check_batch_args, check_split, generator
from dynpipe.data.masking import mask_tokens
from dynpipe.errors import UserError
from dynpipe.models.base import InputSpec, LayeredModel

__all__ = ["SyntheticSource", "token_task"]

_LATENT_SIDE = 4
_PROTOTYPES_PER_CLASS = 2  # two clusters per class: learnable, but not linearly separable
_SPREAD = 0.5  # noise around a prototype, relative to the prototypes' unit scale
_NOISE_BLOCK = 4  # image pixel noise is drawn per 4x4 block of pixels


@functools.lru_cache(maxsize=8)
def _upsampler(n_in: int, n_out: int) -> torch.Tensor:
    """``[n_out, n_in]`` matrix of 1-d linear interpolation (``align_corners=False``)."""
    eye = torch.eye(n_in)[:, None, :]
    return F.interpolate(eye, size=n_out, mode="linear", align_corners=False)[
        :, 0, :
    ].T.contiguous()


def token_task(model: LayeredModel) -> str:
    """``"mlm"`` for a masked-LM model (its loss ignores -100 targets), else ``"lm"``."""
    from dynpipe.models.bert import mlm_cross_entropy

    return "mlm" if model.loss_fn is mlm_cross_entropy or model.name == "bert" else "lm"


class SyntheticSource:
    """Batches for ``spec`` generated from ``(seed, split, step)``; ``num_samples`` is None."""

    name = "synthetic"
    num_samples: int | None = None

    def __init__(
        self,
        spec: InputSpec | None,
        *,
        task: str = "auto",
        seed: int = 0,
        noise: float = 0.05,
        mask_prob: float = 0.15,
        model_name: str = "",
        split: str = "train",
    ) -> None:
        check_split(self.name, split)
        self.spec = spec
        self.split = split
        self.seed = seed
        self.noise = noise
        self.mask_prob = mask_prob
        self.model_name = model_name
        self._tables: dict[tuple[int, int], torch.Tensor] = {}
        self.task = self._pick_task(spec, task) if spec is not None else task

    def __getstate__(self) -> dict:
        # Pickled to loader workers (see ``loader``): the rule tables are rebuilt there.
        return {**self.__dict__, "_tables": {}}

    def __repr__(self) -> str:
        shape = "unbound" if self.spec is None else "x".join(map(str, self.spec.shape))
        return f"SyntheticSource({self.task}, {shape}, {self.split}, seed={self.seed})"

    def model_kwargs(self, model_name: str) -> dict:
        return {}  # shaped to whatever model it feeds

    def _pick_task(self, spec: InputSpec, task: str) -> str:
        tokens = not spec.dtype.is_floating_point
        if any(d < 1 for d in spec.shape) or not spec.shape:
            raise UserError(
                f"synthetic data cannot shape inputs {spec.shape} for model "
                f"{self.model_name!r}; give the model an input_spec with its per-sample shape"
            )
        if task != "auto":
            if task not in ("classify", "regress", "lm", "mlm"):
                raise UserError(
                    f"synthetic task must be auto, classify, regress, lm or mlm; got {task!r}"
                )
            return task
        if tokens and spec.target_shape == spec.shape:
            return "lm"
        if spec.target_dtype.is_floating_point:
            return "regress"
        if spec.target_shape == () and (spec.num_classes or spec.vocab):
            return "classify"
        raise UserError(
            f"synthetic data has no rule for inputs {spec.shape} {spec.dtype} with targets "
            f"{spec.target_shape} {spec.target_dtype}; pass task=classify|regress|lm|mlm"
        )

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.spec is None:
            raise UserError(
                "synthetic data is shaped by its model: build it with "
                "get_data('synthetic', model=model)"
            )
        check_batch_args(self.name, step, batch_size)
        # Only the samples' generator knows the split: the distribution is shared.
        where = (self.name,) if self.split == "train" else (self.name, self.split)
        gen = generator(self.seed, *where, "step", step, batch_size)
        if self.task in ("lm", "mlm"):
            return self._tokens(gen, batch_size)
        if self.spec.dtype.is_floating_point:
            return self._features(gen, batch_size)
        return self._bag_of_tokens(gen, batch_size)

    # -- float inputs ------------------------------------------------------------------

    def _teacher(self, fan_in: int, fan_out: int) -> torch.Tensor:
        g = generator(self.seed, self.name, "teacher", fan_in, fan_out)
        return torch.randn(fan_in, fan_out, generator=g) / math.sqrt(fan_in)

    def _prototypes(self, classes: int, features: int) -> torch.Tensor:
        g = generator(self.seed, self.name, "prototypes", classes, features)
        return torch.randn(_PROTOTYPES_PER_CLASS * classes, features, generator=g)

    def _features(self, gen: torch.Generator, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        assert spec is not None
        shape = spec.shape
        image = len(shape) >= 3 and min(shape[-2:]) >= _LATENT_SIDE
        c = math.prod(shape[:-2]) if image else 0
        latent_shape = (c, _LATENT_SIDE, _LATENT_SIDE) if image else shape
        n_latent = math.prod(latent_shape)
        if self.task == "regress":
            z = torch.randn(b, n_latent, generator=gen)
            out = math.prod(spec.target_shape)
            y = (z @ self._teacher(n_latent, out)).reshape(b, *spec.target_shape)
        else:
            classes = spec.num_classes or spec.vocab or 2
            protos = self._prototypes(classes, n_latent)
            k = torch.randint(0, len(protos), (b,), generator=gen)
            z = protos[k] + _SPREAD * torch.randn(b, n_latent, generator=gen)
            # The teacher labels each input by its nearest prototype, so a sample drawn near
            # a boundary gets the label its position deserves, not the one it was drawn from.
            y = torch.cdist(z, protos).argmin(dim=1) % classes
        x = self._image(z.view(b, *latent_shape), shape, gen) if image else z.view(b, *shape)
        return x.to(spec.dtype), y.to(spec.target_dtype)

    def _image(self, z: torch.Tensor, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        """Bilinear upsampling of the latent plus pixel noise in 4x4 blocks.

        A batch of 224x224 images must cost well under a GPU step (tens of ms), or the
        first stage waits for data: the upsampling is two small matrix products (the same
        bilinear weights as ``F.interpolate``, 5x cheaper here) and the noise is drawn at a
        quarter of the resolution (16x fewer random numbers).
        """
        b, h, w = z.shape[0], shape[-2], shape[-1]
        x = _upsampler(_LATENT_SIDE, h) @ z @ _upsampler(_LATENT_SIDE, w).T
        hb, wb = -(-h // _NOISE_BLOCK), -(-w // _NOISE_BLOCK)
        noise = torch.randn(b, z.shape[1], hb, 1, wb, 1, generator=gen).mul_(0.1)
        noise = noise.expand(-1, -1, -1, _NOISE_BLOCK, -1, _NOISE_BLOCK)
        noise = noise.reshape(b, z.shape[1], hb * _NOISE_BLOCK, wb * _NOISE_BLOCK)[..., :h, :w]
        return x.add_(noise).reshape(b, *shape)

    # -- token inputs ------------------------------------------------------------------

    def _rule(self, vocab: int) -> tuple[int, int]:
        g = generator(self.seed, self.name, "rule", vocab)
        while True:  # a multiplier coprime with vocab makes the rule a permutation
            a = int(torch.randint(1, max(vocab, 2), (), generator=g))
            if math.gcd(a, vocab) == 1:
                break
        b = int(torch.randint(0, vocab, (), generator=g))
        return a, b

    def _powers(self, vocab: int, length: int) -> torch.Tensor:
        """``table[k, v]``: token ``v`` after ``k`` applications of the rule (cached)."""
        key = (vocab, length)
        if key not in self._tables:
            a, c = self._rule(vocab)
            table = torch.empty(length, vocab, dtype=torch.long)
            table[0] = torch.arange(vocab)
            for k in range(1, length):
                table[k] = (a * table[k - 1] + c) % vocab
            self._tables[key] = table
        return self._tables[key]

    def _sequences(self, gen: torch.Generator, b: int, t: int, vocab: int) -> torch.Tensor:
        # A sequence restarts from a random token at position 0 and at each noisy position,
        # then follows the rule: token i is the rule applied (i - last restart) times to the
        # token drawn at the last restart. Vectorised, so long sequences cost no Python loop.
        restart = torch.rand(b, t, generator=gen) < self.noise
        restart[:, 0] = True
        drawn = torch.randint(0, vocab, (b, t), generator=gen)
        pos = torch.arange(t).expand(b, t)
        last = torch.where(restart, pos, torch.zeros_like(pos)).cummax(dim=1).values
        return self._powers(vocab, t)[pos - last, drawn.gather(1, last)]

    def _tokens(self, gen: torch.Generator, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        assert spec is not None
        if spec.vocab is None or len(spec.shape) != 1:
            raise UserError(
                f"synthetic {self.task} data needs 1-d token inputs with a vocab; model "
                f"{self.model_name!r} has inputs {spec.shape} vocab={spec.vocab}"
            )
        t = spec.shape[0]
        if self.task == "lm":
            seq = self._sequences(gen, b, t + 1, spec.vocab)
            return seq[:, :-1].to(spec.dtype), seq[:, 1:].to(spec.target_dtype)
        if spec.vocab < 3:
            raise UserError(
                f"synthetic mlm data needs vocab >= 3 (one is the mask), got {spec.vocab}"
            )
        # The top token id is the mask, so sequences use the others.
        seq = self._sequences(gen, b, t, spec.vocab - 1)
        x, y = mask_tokens(seq, vocab=spec.vocab, gen=gen, prob=self.mask_prob)
        return x.to(spec.dtype), y.to(spec.target_dtype)

    def _bag_of_tokens(self, gen: torch.Generator, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        assert spec is not None
        vocab = spec.vocab or 2
        x = torch.randint(0, vocab, (b, *spec.shape), generator=gen)
        counts = F.one_hot(x.flatten(1), vocab).float().mean(dim=1)
        classes = spec.num_classes or 2
        y = (counts @ self._teacher(vocab, classes)).argmax(dim=1)
        return x.to(spec.dtype), y.to(spec.target_dtype)
