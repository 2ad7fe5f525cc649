"""The delayed reveal (meshlm.model.reveal, meshlm.train.reveal): each row's loop starts from a
partial input and sees the whole one some steps later. Checked against the loop written by hand,
row by row against the row alone, the hidden tokens against the chain's roots recomputed from the
text, the draws against world size and micro-batch split, and the refusals."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import build, tiny
from trainkit import make_task_data

from meshlm.data.prepare import PreparedData
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import ConfigError
from meshlm.model.exit import ExitRule
from meshlm.model.reveal import Reveal
from meshlm.reasoning import TASKS
from meshlm.train.batches import windows_xy
from meshlm.train.reveal import RevealDraws

VOCAB = 48


def model_of(scheme: str = "anchor"):
    torch.manual_seed(0)
    return build(tiny(spec="1+1R3+1", scheme=scheme, vocab_size=VOCAB, context_length=16))


def by_hand(model, x: torch.Tensor, early: torch.Tensor, hidden: int, loops: int) -> torch.Tensor:
    """Anchor's loop with the early input for the states h⁰ … h^{hidden − 1}: h^{t+1} =
    core(h^t) + (the early prelude output while h^{t+1} is hidden, else the true one)."""
    t = x.shape[1]
    rope = model.rotary(torch.arange(t).expand_as(x), model.embed_in.weight.dtype)

    def prelude(ids):
        return model.prelude(model.embed_in(ids) * model.embed_scale, rope, None)

    p, p_early = prelude(x), prelude(early)
    h = p_early if hidden > 0 else p
    for step in range(loops):
        h = model.cores[0](h, rope, None) + (p_early if step + 1 < hidden else p)
    return model.head(model.coda(h, rope, None))


@pytest.mark.parametrize("hidden", [0, 1, 2, 5])
def test_a_revealed_loop_is_the_loop_written_by_hand(hidden):
    model = model_of()
    x = torch.randint(3, VOCAB, (2, 12))
    early = x.masked_fill(x % 3 == 0, 2)
    steps = torch.full((2,), hidden)
    with torch.no_grad():
        ours = model(x, loops=4, reveal=Reveal(early, steps)).logits
        torch.testing.assert_close(ours, by_hand(model, x, early, hidden, 4), rtol=0, atol=1e-5)
        if hidden == 0:  # nothing hidden: the plain forward, bit for bit
            assert torch.equal(ours, model(x, loops=4).logits)


def test_each_row_switches_at_its_own_step_with_gradients():
    model = model_of("dynamic-mix")
    x = torch.randint(3, VOCAB, (3, 10))
    early = x.masked_fill(x % 2 == 0, 2)
    steps = torch.tensor([0, 2, 4])
    logits = model(x, loops=3, reveal=Reveal(early, steps)).logits
    for row in range(3):
        one = slice(row, row + 1)
        alone = model(x[one], loops=3, reveal=Reveal(early[one], steps[one]))
        torch.testing.assert_close(logits[row:row + 1], alone.logits, rtol=1e-5, atol=1e-5)
    logits.sum().backward()  # the early and the true prelude both get gradients
    assert model.prelude[0].attention.query_key_value.weight.grad.abs().sum() > 0


def test_schemes_that_do_not_reinject_and_inference_settings_are_refused():
    x = torch.randint(3, VOCAB, (1, 8))
    reveal = Reveal(x, torch.ones(1, dtype=torch.long))
    for scheme in ("base", "mesh"):
        with pytest.raises(ConfigError, match="reveal needs a scheme that re-injects its input"):
            model_of(scheme)(x, reveal=reveal)
    with pytest.raises(ConfigError, match="reveal is a training setting: .* exit"):
        model_of()(x, reveal=reveal, exit=ExitRule.parse("state:0.1"))


@pytest.fixture(scope="module")
def chain_data(tmp_path_factory):
    return make_task_data(tmp_path_factory.mktemp("tasks"), "chain")


def test_the_hidden_tokens_are_exactly_the_roots_values(chain_data):
    """The given values: input tokens that are also labels. On chain those are the root cells'
    digits, recomputed here from the text (a root's content is a digit, a node's a letter)."""
    data = PreparedData(chain_data, "train")
    tok = load_tokenizer(chain_data / "tokenizer.json")
    block = data.manifest["task"]["block"]
    x, _ = windows_xy(data, list(range(16)), block)
    draws = RevealDraws(data, most=3, seed=0)
    assert tok.decode([draws.hidden]) == "<|unk|>"
    early = draws.reveal(x, torch.zeros(16, dtype=torch.long)).early_ids
    for ids, seen in zip(x.tolist(), early.tolist()):
        text = tok.decode(ids)
        roots = {i + 1 for i in range(0, len(text), 2) if text[i + 1].isdigit()}
        assert len(roots) == TASKS["chain"].roots
        assert {i for i, (a, b) in enumerate(zip(ids, seen)) if a != b} == roots
        assert {seen[i] for i in roots} == {draws.hidden}


def test_draws_are_one_global_batch_cut_by_rank_and_micro_batch(chain_data):
    draws = RevealDraws(PreparedData(chain_data, "train"), most=4, seed=3)
    whole = torch.cat(draws.steps(7, 16, 0, 1, 1))
    assert set(whole.tolist()) <= set(range(5)) and len(set(whole.tolist())) > 1
    cut = [part for rank in range(2) for part in draws.steps(7, 16, rank, 2, 2)]
    assert [len(p) for p in cut] == [4] * 4 and torch.equal(torch.cat(cut), whole)
    assert torch.equal(torch.cat(draws.steps(7, 16, 0, 1, 1)), whole)  # a function of the step
    assert not torch.equal(torch.cat(draws.steps(8, 16, 0, 1, 1)), whole)


def test_training_with_a_reveal_and_its_refusals(chain_data, tmp_path, tmp_path_factory):
    from trainkit import make_prepared

    from meshlm.train.config import TrainConfig
    from meshlm.train.trainer import train

    cfg = TrainConfig(model={"preset": "tiny", "vocab_size": VOCAB, "spec": "1+1R2+1",
                             "scheme": "anchor"},
                      data=str(chain_data), out_dir=str(tmp_path), name="reveal", steps=3,
                      global_batch=8, micro_batch=4, loops="uniform:2-4", reveal=2, eval_every=0,
                      save_every=3, eval_windows=4, progress=False, tensorboard=False)
    result = train(cfg)
    assert result.steps == 3 and result.val_loss == result.val_loss  # finite, trained
    with pytest.raises(ConfigError, match=r"train.reveal=2 needs a scheme that re-injects .* "
                                          r"set model.scheme=anchor or train.reveal=0"):
        train(dataclasses.replace(cfg, name="base", model={**cfg.model, "scheme": "base"}))
    assert not (tmp_path / "base").exists()
    with pytest.raises(ConfigError, match="train.reveal=2 hides the given values of labelled "
                                          "task data, but .* has no labels"):
        train(dataclasses.replace(cfg, name="text", data=str(make_prepared(tmp_path_factory))))
    with pytest.raises(ConfigError, match="reveal=-1 must be an integer >= 0"):
        TrainConfig(reveal=-1).validate()
