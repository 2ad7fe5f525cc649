"""Self-speculative decoding: the staged forward, cache rollback, exact greedy output, the sampling rule."""
import pytest
import torch
from conftest import build, tiny

from meshlm.model import SCHEMES
from meshlm.model.kv_cache import KVCache
from meshlm.model.schemes import concat_contexts


@pytest.mark.parametrize("scheme", sorted(set(SCHEMES) - {"vanilla"}))
def test_a_loop_stopped_joined_and_resumed_equals_the_forward(scheme):
    """Draft runs of one token each, stopped after K_d steps, joined along T and resumed to K: same logits as
    one cached forward over those tokens (the per-token scheme state carries over exactly)."""
    model = build(tiny(scheme=scheme, spec="1+2R3+1"))
    schedule, ids = model.config.layout.schedule, torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        reference = model(ids).logits
        cache = KVCache()
        runs = [model.advance(model.enter(ids[:, i:i + 1], cache=cache), schedule, stop=1) for i in range(6)]
        joined = runs[0]
        joined.h, joined.ctx = torch.cat([r.h for r in runs], 1), concat_contexts([r.ctx for r in runs])
        joined.rope, joined.mask = model.attention_inputs((1, 6), 0, None, None, torch.float32)
        joined.cache = KVCache()  # the deeper slots start empty; the shallow ones are not read again
        model.advance(joined, schedule)
        # the resumed loop writes its slots from step 1 on; earlier slots come from the draft cache
        assert (model.readout(joined, schedule) - reference).abs().max() <= 1e-5


def test_crop_forgets_the_tail_of_chosen_slots():
    cache = KVCache()
    for slot in range(3):
        cache.update(torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4), slot)
    cache.crop(3, range(1, 3))
    assert [k.shape[-2] for k in cache.keys] == [5, 3, 3]
    cache.crop(2)
    assert [v.shape[-2] for v in cache.values] == [2, 2, 2]
