"""``hf:`` models: the layers compute what the Hugging Face model computes, training the
layered model matches a plain Hugging Face loop, and bad input is one clear line."""

from __future__ import annotations

import json

import pytest
import torch
from hfutil import SEQ, TINY, hf_logits, save_tiny
from test_runtime_equivalence import BATCH, make_batch

transformers = pytest.importorskip("transformers")

STEPS = 4


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert", "vit"])
def test_layers_equal_the_saved_model(tmp_path, arch: str) -> None:
    from dynpipe.models import get_model

    folder = save_tiny(arch, tmp_path)
    model = get_model(f"hf:{folder}", seq_len=SEQ)
    hf = getattr(transformers, model.config["hf_class"]).from_pretrained(
        folder, attn_implementation="sdpa"
    )
    x, _ = model.input_spec.example(4)
    assert torch.equal(model.build_sequential()(x), hf_logits(hf, x))
    # Every layer is built alone, as a rank that never held it builds it.
    layers = [model.build_layer(i) for i in range(len(model))]
    h = x
    for layer in layers:
        h = layer(h)
    assert torch.equal(h, hf_logits(hf, x))
    assert [t[0][-1] for t in model.trace_shapes(2)][-1] == hf_logits(hf, x).shape[-1]


def test_fresh_architecture_is_hf_init_under_the_seed() -> None:
    from dynpipe.models import get_model

    cfg = {k: v for k, v in TINY["llama"].items()}
    model = get_model("hf:llama", seq_len=SEQ, seed=11, **cfg)
    torch.manual_seed(11)
    conf = transformers.LlamaConfig(**cfg)
    conf._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(conf)
    x, _ = model.input_spec.example(2)
    assert torch.equal(model.build_sequential()(x), hf(x).logits)
    other = get_model("hf:llama", seq_len=SEQ, seed=12, **cfg)
    assert not torch.equal(
        other.build_layer(1)(model.build_layer(0)(x)), model.build_sequential()[:2](x)
    )


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_reference_training_matches_a_plain_hf_loop(tmp_path, arch: str) -> None:
    """The unsplit layered model trained as dynpipe trains (4 microbatches, AdamW) against
    the Hugging Face model in a plain accumulation loop. Not bit-identical: the HF model
    accumulates the tied weight's two gradients into one tensor microbatch by microbatch,
    dynpipe sums each copy's accumulated gradient once at the end, and floating-point
    addition is not associative (the HF loop also scales each microbatch's loss by 1/4 where
    dynpipe divides the summed gradient once). The first step's gradients agree to float32
    rounding; AdamW's normalised update then carries those last-bit differences into the
    weights, so later losses agree to 1e-4 relative."""
    from dynpipe.models import get_model
    from dynpipe.runtime.optim import OptimConfig
    from dynpipe.runtime.reference import ReferenceTrainer

    folder = save_tiny(arch, tmp_path)
    model = get_model(f"hf:{folder}", seq_len=SEQ)
    optim = OptimConfig(name="adamw", lr=3e-3)
    ref = ReferenceTrainer(model=model, batch_size=BATCH, microbatches=4, optim=optim)
    hf = getattr(transformers, model.config["hf_class"]).from_pretrained(
        folder, attn_implementation="sdpa"
    )
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=3e-3)
    for s in range(STEPS):
        batch = make_batch(model, 0)  # one batch, so the loss must fall
        ours = ref.step(s, batch)
        opt.zero_grad()
        losses = []
        for xm, ym in zip(batch[0].tensor_split(4), batch[1].tensor_split(4), strict=True):
            loss = model.loss_fn(hf_logits(hf, xm), ym)
            (loss / 4).backward()
            losses.append(loss.detach())
        if s == 0:
            for name, p in hf.named_parameters():
                mine = _ref_grad(ref, model, name)
                assert torch.allclose(mine, p.grad, rtol=1e-4, atol=1e-7), f"{arch}: {name}"
        opt.step()
        theirs = float(torch.stack(losses).mean())
        assert ours == pytest.approx(theirs, rel=1e-4), f"{arch} step {s}"
    assert ref.losses[-1] < ref.losses[0], "training lowers the loss"


def test_bad_input_is_one_line(tmp_path) -> None:
    from dynpipe.errors import UserError
    from dynpipe.models import get_model

    def err(name: str, **kw) -> str:
        with pytest.raises(UserError) as info:
            get_model(name, **kw)
        msg = str(info.value)
        assert "\n" not in msg, msg
        return msg

    (tmp_path / "empty").mkdir()
    assert "no config.json" in err(f"hf:{tmp_path / 'empty'}")
    msg = err("hf:t5")
    assert "gpt2" in msg and "llama" in msg and "vit" in msg
    assert "not supported" in err(f"hf:{_with_type(tmp_path, 't5')}")
    folder = save_tiny("gpt2", tmp_path)
    msg = err(f"hf:{folder}", n_embd=32)
    assert "has shape [192] but the config gives [96]" in msg, msg
    assert "no field 'hiden_size'" in err("hf:llama", hiden_size=8)
    assert "seq_len=64" in err(f"hf:{folder}", seq_len=64)


def _ref_grad(ref, model, hf_name: str) -> torch.Tensor:
    """The gradient the reference holds for the HF parameter ``hf_name``."""
    from dynpipe.models.cut import source_state

    grads = {n: p.grad for n, p in ref.named_params.items()}
    return source_state(model, grads)[hf_name]


def _with_type(tmp_path, model_type: str):
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return d


def test_text_goes_through_the_models_own_tokenizer(tmp_path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dynpipe.data import get_data
    from dynpipe.models import get_model

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "".join(f"the pipeline moves layer {i} to stage {i % 3}.\n" for i in range(400))
    )
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=TINY["gpt2"]["vocab_size"], special_tokens=["[UNK]"])
    tok.train([str(corpus)], trainer)
    assert tok.get_vocab_size() <= TINY["gpt2"]["vocab_size"]
    folder = save_tiny("gpt2", tmp_path)
    tok.save(str(folder / "tokenizer.json"))
    model = get_model(f"hf:{folder}", seq_len=SEQ)
    data = get_data("text", model=model, path=str(corpus))
    x, y = data.batch(0, 4)
    assert x.shape == (4, SEQ) and int(x.max()) < TINY["gpt2"]["vocab_size"]
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-token targets over the same ids
    text = corpus.read_text()
    # Metaspace marks each line's (here: each encoded chunk's) start with a space.
    window = tok.decode(x[0].tolist()).strip().replace("\n ", "\n")
    assert len(window) > SEQ and window in text  # merged tokens: more characters than ids
    # Byte-level data would need vocab 256: the tokenizer is what lets a 96-token model read it.
    plain = get_model("hf:gpt2", seq_len=SEQ, **TINY["gpt2"])
    with pytest.raises(Exception, match="vocab"):
        get_data("text", model=plain, path=str(corpus))
