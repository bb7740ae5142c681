"""``dynpipe.models.from_module``: a user's block-structured module as a layered model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dynpipe.errors import UserError
from dynpipe.models import InputSpec, from_module
from dynpipe.models.gpt import lm_cross_entropy

VOCAB, WIDTH, SEQ = 50, 32, 8


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x + torch.tanh(self.fc(self.norm(x))), None  # a tuple, as HF blocks return


class _Net(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Module()
        self.body.layers = nn.ModuleList(_Block() for _ in range(depth))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models do

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.body.layers:
            x = block(x)[0]
        return self.head(self.norm(x))


def _cut(net: nn.Module, **kw):
    spec = InputSpec(shape=(SEQ,), dtype=torch.long, target_shape=(SEQ,), vocab=VOCAB)
    return from_module(
        net, blocks="body.layers", before=["embed"], after=["norm", "head"],
        loss=lm_cross_entropy, input_spec=spec, name="net", **kw,
    )  # fmt: skip


def test_cut_module_computes_the_module_and_finds_the_tie() -> None:
    from dynpipe.models.cut import source_state

    torch.manual_seed(0)
    net = _Net()
    model = _cut(net)
    assert model.layer_names == ["embed", "block00", "block01", "block02", "head"]
    assert model.ties == (("embed.embed.weight", "head.head.weight"),)
    x, _ = model.input_spec.example(4)
    seq = model.build_sequential()
    assert torch.equal(seq(x), net(x))
    # Each owner has its own copy (a pipeline stage holds only its own layers).
    assert seq.embed.embed.weight is not seq.head.head.weight
    assert torch.equal(seq.embed.embed.weight, seq.head.head.weight)
    back = source_state(model, seq.state_dict())
    assert set(back) == set(net.state_dict())
    net2 = _Net()
    net2.load_state_dict(back)
    assert torch.equal(net2(x), net(x))


def test_blocks_not_found_and_freeze_across_a_tie_are_one_line() -> None:
    from dynpipe.runtime.ties import check_freeze, freeze_limit

    net = _Net()
    with pytest.raises(UserError) as info:
        _cut_blocks(net, "layers")
    msg = str(info.value)
    assert "no submodule 'layers'" in msg and "embed, body, norm, head" in msg and "\n" not in msg
    with pytest.raises(UserError, match="is a LayerNorm with no blocks"):
        _cut_blocks(net, "norm")
    with pytest.raises(UserError, match="no submodule 'normm'"):
        from_module(net, blocks="body.layers", after=["normm"], input_spec=InputSpec(shape=(SEQ,)))
    model = _cut(net)
    check_freeze(model, 0)
    assert [freeze_limit(model, k) for k in range(6)] == [0, 0, 0, 0, 0, 5]
    with pytest.raises(UserError) as info:
        check_freeze(model, 2)
    assert "tied copy head.head.weight" in str(info.value) and "\n" not in str(info.value)


def _cut_blocks(net: nn.Module, blocks: str):
    return from_module(net, blocks=blocks, input_spec=InputSpec(shape=(SEQ,)))


def test_reference_training_of_a_cut_module_matches_the_module() -> None:
    """The unsplit layered model, trained with the tie's gradients summed, equals the
    module trained with its one shared weight (one microbatch: the same additions)."""
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.reference import ReferenceTrainer

    torch.manual_seed(0)
    net = _Net()
    model = _cut(net)
    ref = ReferenceTrainer(model=model, batch_size=4, microbatches=1,
                           optim=OptimConfig(name="sgd", lr=0.1, momentum=0.0))  # fmt: skip
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for s in range(3):
        x = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        ours = ref.step(s, (x, y))
        opt.zero_grad()
        loss = lm_cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        assert ours == pytest.approx(float(loss.detach()), rel=1e-6)
    state = ref.model_state()
    assert torch.equal(state["embed.embed.weight"], state["head.head.weight"])
    assert torch.allclose(state["embed.embed.weight"], net.embed.weight, atol=1e-6)
