"""The Decoder protocol (meshlm.generate.decoder): plain, exit and speculative decoders prefill a
Batch and step it, and the one loop `decode` over any of them gives the tokens `generate` gives."""
import pytest
import torch
from conftest import build, tiny

from meshlm.generate import (
    Decoder,
    PlainDecoder,
    Sampling,
    Speculation,
    SpeculativeDecoder,
    decode,
    generate,
    left_pad,
    next_token,
)
from meshlm.model.exit import ExitRule

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]
EOS, PAD = 3, 1


def _decoded(decoder: Decoder, s: Sampling) -> list[list[int]]:
    """Each row's tokens from the one loop, up to and including EOS."""
    out: list[list[int]] = [[] for _ in PROMPTS]
    batch = decoder.prefill(*left_pad(PROMPTS, PAD))
    for token in decode(decoder, batch, s, EOS, PAD):
        for row, t in enumerate(token.tolist()):
            if not out[row] or out[row][-1] != EOS:
                out[row].append(t)
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("kind", ["plain", "exit", "speculate"])
def test_every_decoder_driven_by_the_one_loop_gives_generates_tokens(kind, temperature):
    model = build(tiny(spec="1+1R4+1"))
    s = Sampling(max_new_tokens=12, temperature=temperature, seed=7)
    exit = ExitRule.parse("state:0.05") if kind == "exit" else None
    speculate = Speculation(2, 3) if kind == "speculate" else None
    generator = torch.Generator().manual_seed(s.seed)
    if speculate is None:
        decoder = PlainDecoder(model, model.schedule(), lambda x: next_token(x, s, generator), exit)
    else:
        decoder = SpeculativeDecoder(model, model.schedule(), speculate, s, generator)
    assert isinstance(decoder, Decoder)  # the protocol's methods, by name
    want = generate(model, PROMPTS, s, EOS, PAD, exit=exit, speculate=speculate)
    assert _decoded(decoder, s) == want
    if temperature == 0 and speculate is None:  # greedy: the recompute path agrees as well
        assert want == generate(model, PROMPTS, s, EOS, PAD, cache=False, exit=exit)


def test_a_plain_step_sliced_into_loop_steps_equals_the_whole_step():
    model = build(tiny(spec="1+1R4+1"))
    s = Sampling(max_new_tokens=4, temperature=0)
    whole, sliced = (PlainDecoder(model, model.schedule(), lambda x: next_token(x, s))
                     for _ in range(2))
    a, b = whole.prefill(*left_pad(PROMPTS, PAD)), sliced.prefill(*left_pad(PROMPTS, PAD))
    want = whole.step(a)
    slices = [sliced.step(b, loop_slice=1) for _ in range(4)]
    assert slices[:3] == [None] * 3 and sliced.busy is False
    assert slices[3].tokens == want.tokens and torch.equal(a.mask, b.mask)
