"""The looped KV cache: slots, padding, chunked prefill, in-place appends, and the decoding helper
the model battery (test_model_battery.py) runs over every backbone × scheme and loop count."""
import pytest
import torch
from conftest import build, tiny

from meshlm.errors import ConfigError
from meshlm.model.kv_cache import KVCache, slot_offsets

PROMPT_LENGTHS = (5, 2, 7)  # batch 3, left-padded to 7
STEPS = 20


def left_padded(lengths, vocab, seed=0):
    """(B, max) token ids with real tokens on the right, and the (B, max) padding mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(2, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1
        ids[row, :width - n] = 1  # pad id
    return ids, mask


def decode_both_ways(model, loops=None, steps=STEPS):
    """Largest |cached − uncached| logit difference over the prefill (real tokens) and `steps`
    decode steps. The uncached reference is one forward over the whole sequence: its logits at
    position p are those of the prefix ending at p (causality, which the model battery checks), as
    in transformers' past-key-values tests."""
    ids, mask = left_padded(PROMPT_LENGTHS, model.config.vocab_size)
    cache = KVCache()
    with torch.no_grad():
        cached = [model(ids, padding_mask=mask, cache=cache, loops=loops).logits]
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            nxt = torch.randint(2, model.config.vocab_size, (ids.shape[0], 1), generator=g)
            ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
            cached.append(model(nxt, padding_mask=mask, cache=cache, loops=loops).logits)
        full = model(ids, padding_mask=mask, loops=loops).logits
    worst = (torch.cat(cached, 1) - full)[mask.bool()].abs().max().item()
    return worst, cache


# Cached == uncached decoding for every backbone × scheme and loop count: test_model_battery.py.
def test_left_padded_rows_decode_like_unpadded_prompts():
    """Row r of a left-padded batch gives the same logits as its prompt alone (positions count real
    tokens)."""
    model = build(tiny(spec="1+2R2+1"))
    ids, mask = left_padded(PROMPT_LENGTHS, model.config.vocab_size)
    with torch.no_grad():
        batched = model(ids, padding_mask=mask, cache=KVCache()).logits[:, -1]
        for row, n in enumerate(PROMPT_LENGTHS):
            alone = model(ids[row:row + 1, -n:]).logits[:, -1]
            assert (batched[row] - alone[0]).abs().max() <= 1e-5


def test_chunked_prefill_without_padding_mask():
    """Several new tokens after a cached past are causal with respect to each other and see the
    whole past."""
    model = build(tiny())
    x = torch.randint(0, model.config.vocab_size, (2, 11))
    cache = KVCache()
    with torch.no_grad():
        first = model(x[:, :6], cache=cache).logits
        second = model(x[:, 6:], cache=cache).logits
        full = model(x).logits
    assert (torch.cat([first, second], 1) - full).abs().max() <= 1e-5


def test_slots_follow_execution_order():
    model = build(tiny(spec="2+3R2+1", scheme="base"))
    assert slot_offsets(model.config.layout, model.schedule()) == (0, [2, 5], 8, 9)
    assert slot_offsets(model.config.layout, model.schedule(loops=3)) == (0, [2, 5, 8], 11, 12)
    # each pass of the shared core stores different keys (it attends over different states)
    cache = KVCache()
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 4)), cache=cache)
    assert not torch.allclose(cache.keys[2], cache.keys[5])


def test_mask_that_does_not_cover_the_cache_is_a_clear_error():
    model = build(tiny())
    cache = KVCache()
    with torch.no_grad():
        model(torch.ones(1, 4, dtype=torch.long), cache=cache)
        with pytest.raises(ConfigError, match="pass a mask over all 5 tokens"):
            model(torch.ones(1, 1, dtype=torch.long), padding_mask=torch.ones(1, 1), cache=cache)


def test_cache_beyond_context_is_a_clear_error():
    model = build(tiny(context_length=6))
    cache = KVCache()
    with torch.no_grad():
        model(torch.ones(1, 6, dtype=torch.long), cache=cache)
        with pytest.raises(ConfigError, match="exceeds the model's context_length=6"):
            model(torch.ones(1, 1, dtype=torch.long), cache=cache)


def test_appends_write_in_place_and_the_buffers_double_when_full():
    """A decode step writes its own keys/values into the slot's buffer (no copy of the history)
    until the buffer is full; then it doubles. The filled views always equal the concatenated
    history."""
    cache, history = KVCache(), []
    pointers = []
    for t in (3, 1, 1, 1, 1):  # a 3-token prefill, then single tokens: room 3 → 6 → 6 → 6 → 12
        key = torch.randn(2, 4, t, 8)
        history.append(key)
        keys, values = cache.update(key, -key, 0)
        assert torch.equal(keys, torch.cat(history, -2)) and torch.equal(values, -keys)
        pointers.append(keys.data_ptr())
    assert pointers[1] != pointers[0] and pointers[1] == pointers[2] == pointers[3] != pointers[4]
    assert cache.get_seq_length() == 7
    cache.crop(5)  # rolled back: the next append overwrites position 5
    key = torch.randn(2, 4, 1, 8)
    assert torch.equal(cache.update(key, key, 0)[0], torch.cat([*history[:3], key], -2))


def test_a_cache_under_autograd_gives_the_gradients_of_the_whole_sequence():
    """Chunks run with grad through a cache concatenate (nothing autograd saved is written over):
    the gradients equal those of one forward over the whole sequence."""
    model = build(tiny(scheme="mesh"))
    x = torch.randint(0, model.config.vocab_size, (2, 9))
    cache = KVCache()
    # room 4, then 8 (a copy), then the third chunk would be written in place into a buffer autograd
    # saved
    chunked = torch.cat([model(x[:, a:b], cache=cache).logits
                         for a, b in ((0, 4), (4, 6), (6, 7), (7, 9))], 1)
    chunked.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).logits.square().mean().backward()
    assert all(torch.allclose(g, p.grad, atol=1e-6) for g, p in zip(grads, model.parameters()))


def test_another_batch_in_the_same_cache_is_a_clear_error():
    cache = KVCache()
    with torch.no_grad():
        cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), 0)
        with pytest.raises(ValueError, match="start a new cache for another batch"):
            # (would broadcast silently)
            cache.update(torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4), 0)


def test_a_query_attends_to_real_keys_and_to_itself_only_where_it_has_none():
    from meshlm.model.layers import attention_mask_from_padding
    # row 0: two left pads, then three real tokens; row 1: real, real, a hole (a static cache's
    # nominal column of the decoded token), real, and the query's own column empty
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 1, 0]])
    mask = attention_mask_from_padding(padding)[:, 0]  # (B, T, S)
    expected = torch.tensor([
        [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 0]]])
    assert torch.equal(mask, expected.bool())
    # one query after four cached columns: the last row of the same mask
    last = attention_mask_from_padding(padding, past=4)[:, 0, 0]
    assert torch.equal(last, expected[:, -1].bool())
