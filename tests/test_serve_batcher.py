"""Continuous batching on its own (no HTTP): requests that join and leave a running batch decode
exactly what they decode alone and what meshlm.generate decodes, for every scheme, with exit and
with speculation."""
import pytest
import torch
from conftest import build, tiny
from test_exit import LOOPS, mid_threshold, x_batch

from meshlm.errors import ConfigError
from meshlm.generate import Sampling, generate
from meshlm.generate.speculative import Speculation
from meshlm.model.exit import ExitRule
from meshlm.model.kv_cache import KVCache
from meshlm.model.schemes import SCHEMES
from meshlm.serve.batcher import Batcher, QueueFull, Request

E, S = ExitRule.parse, Speculation.parse  # the typed settings a Request carries
LOOPED = sorted(name for name in SCHEMES if name != "vanilla")  # every scheme the registry has
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [3], [20, 21, 22, 23]]
LENGTHS = [9, 14, 5, 12, 7]  # max_new_tokens per request: rows leave at different steps


def greedy(n, **kw):
    return Sampling(max_new_tokens=n, temperature=0, stop_at_eos=False, **kw)


def reference(model, r: Request) -> list[int]:
    """What meshlm.generate decodes for the request alone (speculation is lossless: plain
    greedy)."""
    return generate(model, [r.prompt], r.sampling, loops=r.loops, exit=r.exit)[0]


def staggered(batcher: Batcher, requests: list[Request], every: int = 2) -> None:
    """Submit one request every `every` token boundaries, then decode until all are done."""
    pending = list(requests)
    steps = 0
    while pending or batcher.step():
        if pending and steps % every == 0:
            batcher.submit(pending.pop(0))
        batcher.step()
        steps += 1
    assert all(r.done.is_set() for r in requests)


def requests(**kw) -> list[Request]:
    return [Request(p, greedy(n), **kw) for p, n in zip(PROMPTS, LENGTHS)]


@pytest.mark.parametrize("scheme", [*LOOPED, "vanilla"])
def test_joining_and_leaving_rows_decode_as_alone(scheme):
    model = build(tiny(scheme=scheme, spec="1+2+1+1" if scheme == "vanilla" else "1+1R3+1"))
    batcher = Batcher(model, eos_id=0, pad_id=1, max_batch=4)
    rs = requests()
    staggered(batcher, rs)
    assert [r.tokens for r in rs] == [reference(model, r) for r in rs]
    assert [r.finish for r in rs] == ["length"] * len(rs)
    assert batcher.stats.step_rows > batcher.stats.steps  # they did share batches


@pytest.mark.parametrize("scheme", LOOPED)
@pytest.mark.parametrize("criterion", ["state", "kl"])
def test_exit_inside_a_batch_decodes_as_alone_and_skips_loops(scheme, criterion):
    model = build(tiny(scheme=scheme, spec=f"1+1R{LOOPS}+1"))
    # splits tokens after the first step
    rule = E(f"{criterion}:{mid_threshold(model, x_batch(), criterion)}")
    batcher = Batcher(model, eos_id=0, pad_id=1)
    rs = requests(exit=rule)
    staggered(batcher, rs, every=1)
    assert [r.tokens for r in rs] == [reference(model, r) for r in rs]
    stats = batcher.stats
    assert stats.loop_steps < LOOPS * stats.decoded  # some tokens exited early, in a batch


@pytest.mark.parametrize("scheme", LOOPED)
@pytest.mark.parametrize("speculate", ["1:2", "2:3", "auto"])
def test_speculation_inside_a_batch_is_plain_greedy(scheme, speculate):
    model = build(tiny(scheme=scheme, spec="1+1R4+1"))
    batcher = Batcher(model, eos_id=0, pad_id=1)
    rs = requests(speculate=S(speculate))
    staggered(batcher, rs, every=1)
    assert [r.tokens for r in rs] == [reference(model, r) for r in rs]
    if speculate != "auto":
        assert batcher.stats.decoded > batcher.stats.steps  # rounds emitted several tokens per step


def test_mixed_settings_loops_and_seeded_sampling_decode_as_alone():
    model = build(tiny(spec="1+1R3+1"))
    rs = [Request(PROMPTS[0], greedy(8), loops=2),
          Request(PROMPTS[1], greedy(8), exit=E("state:0.2")),
          Request(PROMPTS[2], greedy(8), speculate=S("1:2")), Request(PROMPTS[3], greedy(8)),
          Request(PROMPTS[4],
                  Sampling(max_new_tokens=8, temperature=0.9, top_k=20, seed=3, stop_at_eos=False)),
          Request(PROMPTS[0], Sampling(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=4,
                                       stop_at_eos=False))]
    staggered(Batcher(model, eos_id=0, pad_id=1), rs, every=1)
    assert [r.tokens for r in rs] == [reference(model, r) for r in rs]


def test_slots_are_freed_and_reused_and_the_cache_holds_live_rows_only():
    model = build(tiny(spec="1+1R2+1"))
    batcher = Batcher(model, eos_id=0, pad_id=1, max_batch=2)
    rs = requests()
    for r in rs:
        batcher.submit(r)
    widths = []
    while batcher.step():
        assert batcher.running <= 2
        for cohort in batcher.cohorts.values():
            # fed positions per row
            live = [len(r.prompt) + len(r.tokens) - 1 for r in cohort.requests]
            assert cohort.state.kv.get_seq_length() == cohort.state.mask.shape[1] == max(live)
            widths.append(len(cohort))
    assert [r.tokens for r in rs] == [reference(model, r) for r in rs]
    assert batcher.cohorts == {} and 2 in widths and batcher.stats.admitted == 5


def test_cancel_and_timeout_free_the_slot_at_the_next_boundary():
    model = build(tiny())
    batcher = Batcher(model, eos_id=0, pad_id=1)
    slow, other = Request(PROMPTS[0], greedy(40)), Request(PROMPTS[1], greedy(6))
    late = Request(PROMPTS[2], greedy(40), timeout=0.0)
    for r in (slow, other, late):
        batcher.submit(r)
    batcher.step()
    assert late.finish == "timeout" and not late.tokens  # timed out while queued: never prefilled
    batcher.cancel(slow)
    batcher.step()
    assert slow.finish == "cancelled" and batcher.running == 1 and len(slow.tokens) == 2
    while batcher.step():
        pass
    assert other.tokens == reference(model, other)
    assert batcher.stats.finished == {"stop": 0, "length": 1, "cancelled": 1, "timeout": 1,
                                      "error": 0, "shutdown": 0}


def test_eos_ends_a_row_and_one_token_requests_never_join():
    model = build(tiny())
    with torch.no_grad():
        model.embed_out.weight[0] += 10.0 * model.embed_out.weight[7]  # token 0 (EOS) often wins
    batcher = Batcher(model, eos_id=0, pad_id=1)
    rs = [Request(p, Sampling(max_new_tokens=n, temperature=0))
          for p, n in zip(PROMPTS, [1, 12, 12, 12, 12])]
    staggered(batcher, rs, every=1)
    assert [r.tokens for r in rs] == [reference(model, r) for r in rs]
    assert all(r.finish == ("stop" if r.tokens[-1] == 0 else "length") for r in rs)


def test_bounded_queue_and_bad_requests_are_refused_before_any_work():
    model = build(tiny(context_length=16))
    batcher = Batcher(model, eos_id=0, pad_id=1, max_queue=2)
    batcher.submit(Request([5], greedy(3)))
    batcher.submit(Request([6], greedy(3)))
    with pytest.raises(QueueFull, match="max_queue=2"):
        batcher.submit(Request([7], greedy(3)))
    for bad, message in [(Request(list(range(2, 17)), greedy(4)), "exceeds context_length=16"),
                         (Request([5], greedy(3), speculate=S("9")), "must be in 1"),
                         (Request([5], greedy(3), speculate=S("1"), exit=E("state:0.1")),
                          "cannot be combined"),
                         (Request([500], greedy(3)), "token ids must be in 0")]:
        with pytest.raises(ConfigError, match=message):
            batcher.check(bad)


@pytest.mark.parametrize("settings",
                         [{}, {"exit": E("state:0.2")}, {"exit": E("kl:0.002")},
                          {"speculate": S("2:2")}, {"speculate": S("auto")}, {"loops": 2}])
def test_newcomers_prefilled_together_decode_as_alone(settings):
    model = build(tiny(spec="1+1R4+1"))
    batcher = Batcher(model, eos_id=0, pad_id=1)
    rs = requests(**settings)
    for r in rs:  # all waiting at the first boundary: one left-padded prefill
        batcher.submit(r)
    batcher.step()
    assert batcher.running == len(rs) and batcher.stats.steps == 1
    while batcher.step():
        pass
    assert [r.tokens for r in rs] == [reference(model, r) for r in rs]


def test_a_failing_batch_ends_its_own_requests_and_the_others_go_on(monkeypatch):
    from meshlm.serve import cohorts

    model = build(tiny(spec="1+1R3+1"))
    batcher = Batcher(model, eos_id=0, pad_id=1)
    broken = Request(PROMPTS[0], greedy(6), exit=E("state:0.1"))
    fine = Request(PROMPTS[1], greedy(6))
    real_step = cohorts.PlainCohort.step

    def step(self, loop_slice=None):
        if self.exit is not None:
            raise RuntimeError("out of memory")
        return real_step(self, loop_slice)
    monkeypatch.setattr(cohorts.PlainCohort, "step", step)
    batcher.submit(broken)
    batcher.submit(fine)
    while batcher.step():
        pass
    assert broken.finish == "error" and "out of memory" in broken.error and broken.done.is_set()
    assert fine.finish == "length" and fine.tokens == reference(model, fine)


@pytest.mark.parametrize("scheme", [*LOOPED, "vanilla"])
def test_chunked_prefill_decodes_as_alone(scheme):
    """Newcomers whose prompts are longer than the chunk prefill 3 columns per boundary while the
    others decode; every row still decodes what it decodes alone (exit included)."""
    model = build(tiny(scheme=scheme, spec="1+2+1+1" if scheme == "vanilla" else "1+1R3+1"))
    batcher = Batcher(model, eos_id=0, pad_id=1, prefill_chunk=3)
    rs = requests() + [Request(list(range(30, 41)), greedy(6), exit=None if scheme == "vanilla"
                               else E("state:0.2"))]
    staggered(batcher, rs, every=1)
    assert [r.tokens for r in rs] == [reference(model, r) for r in rs]


def test_a_long_prompt_prefills_a_chunk_per_boundary_while_the_others_decode():
    model = build(tiny(spec="1+1R2+1", context_length=128))
    batcher = Batcher(model, eos_id=0, pad_id=1, prefill_chunk=4)
    running, long = Request(PROMPTS[1], greedy(30)), Request(list(range(2, 42)), greedy(5))
    batcher.submit(running)
    batcher.step()  # nothing else decodes: the short prompt prefills whole
    batcher.submit(long)
    prefilled = []
    for _ in range(12):
        before = len(running.tokens)
        batcher.step()
        assert len(running.tokens) == before + 1  # the running row gets a token every boundary
        prefilled.append(sum(p.done for p in batcher.prefilling))
        assert batcher.running == 2
    assert prefilled[:9] == [4, 8, 12, 16, 20, 24, 28, 32, 36] and prefilled[9] == 0  # 40 = 10 × 4
    # as at any admission, the prefill's token and the first decoded one at the 10th boundary
    assert len(long.tokens) == 4
    while batcher.step():
        pass
    assert [running.tokens, long.tokens] == [reference(model, running), reference(model, long)]


def test_a_request_stopped_while_its_prompt_prefills_frees_its_row():
    model = build(tiny(spec="1+1R2+1", context_length=128))
    batcher = Batcher(model, eos_id=0, pad_id=1, prefill_chunk=4)
    running = Request(PROMPTS[1], greedy(20))
    batcher.submit(running)
    batcher.step()
    cancelled, kept = Request(list(range(2, 30)), greedy(5)), Request(list(range(5, 25)), greedy(5))
    batcher.submit(cancelled)
    batcher.submit(kept)
    batcher.step()  # both joined one prefill group
    prefill, = batcher.prefilling
    assert len(prefill) == 2 and prefill.done == 4
    batcher.cancel(cancelled)
    batcher.step()
    assert cancelled.finish == "cancelled" and not cancelled.tokens and len(prefill) == 1
    assert batcher.running == 2
    while batcher.step():
        pass
    assert kept.tokens == reference(model, kept) and running.tokens == reference(model, running)


def test_a_bad_prefill_chunk_is_refused():
    with pytest.raises(ConfigError, match="prefill_chunk=0 must be >= 1"):
        Batcher(build(tiny()), eos_id=0, pad_id=1, prefill_chunk=0)


def test_a_failing_chunked_prefill_ends_its_own_requests_and_the_others_go_on(monkeypatch):
    from meshlm.serve import cohorts

    model = build(tiny(spec="1+1R2+1", context_length=128))
    batcher = Batcher(model, eos_id=0, pad_id=1, prefill_chunk=4)
    running, broken = Request(PROMPTS[1], greedy(12)), Request(list(range(2, 30)), greedy(5))
    real_advance = cohorts.Prefill.advance

    def advance(self, *args):
        if self.done >= 8:
            raise RuntimeError("out of memory")
        return real_advance(self, *args)
    monkeypatch.setattr(cohorts.Prefill, "advance", advance)
    batcher.submit(running)
    batcher.step()
    batcher.submit(broken)
    while batcher.step():
        pass
    assert broken.finish == "error" and "out of memory" in broken.error and not broken.tokens
    assert running.finish == "length" and running.tokens == reference(model, running)
    assert batcher.prefilling == [] and batcher.running == 0


def poisoned_draws(monkeypatch, seed: int, after: int):
    """Sampling raises (as torch.multinomial does on inf/nan probabilities) for the request seeded
    `seed` from its `after`-th draw on; every other draw is meshlm's own."""
    from meshlm.serve import cohorts

    real, calls = cohorts.next_token, []

    def next_token(logits, s, generator=None):
        if s.seed == seed:
            calls.append(1)
            if len(calls) > after:
                raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, s, generator)
    monkeypatch.setattr(cohorts, "next_token", next_token)


@pytest.mark.parametrize("after", [0, 3])  # its first token (the prefill) or mid-decoding
@pytest.mark.parametrize("chunk", [None, 3])
def test_a_row_that_fails_alone_ends_alone_and_its_neighbours_decode_as_alone(monkeypatch, after,
                                                                              chunk):
    """One request's failure (its sampling) fails that request only: the requests admitted with it
    at the same boundary, in the same cohort, finish with the tokens they decode alone."""
    poisoned_draws(monkeypatch, seed=666, after=after)
    model = build(tiny(spec="1+1R3+1"))
    batcher = Batcher(model, eos_id=0, pad_id=1, prefill_chunk=chunk)
    bad = Request(PROMPTS[0], Sampling(max_new_tokens=8, temperature=1.0, seed=666,
                                       stop_at_eos=False))
    good = requests()
    sampled = Request(PROMPTS[2], Sampling(max_new_tokens=8, temperature=1.0, seed=7,
                                           stop_at_eos=False))
    for r in [good[0], bad, *good[1:], sampled]:  # one boundary: one prefill, one cohort
        batcher.submit(r)
    while batcher.step():
        pass
    assert bad.finish == "error" and "inf, nan" in bad.error and len(bad.tokens) == after
    assert [r.finish for r in good] == ["length"] * len(good)
    assert [r.tokens for r in good] == [reference(model, r) for r in good]
    alone = Request(PROMPTS[2], sampled.sampling)
    assert sampled.tokens == generate(model, [alone.prompt], alone.sampling)[0]


def test_loops_are_capped_at_4x_the_trained_count_or_max_loops():
    model = build(tiny(spec="1+1R3+1"))
    Batcher(model, eos_id=0, pad_id=1).check(Request([5], greedy(2), loops=12))
    with pytest.raises(ConfigError,
                       match=r"loops=13 is more than .* \(at most 12: 4x the trained 3\)"):
        Batcher(model, eos_id=0, pad_id=1).check(Request([5], greedy(2), loops=13))
    capped = Batcher(model, eos_id=0, pad_id=1, max_loops=5)
    capped.check(Request([5], greedy(2), loops=5))
    with pytest.raises(ConfigError, match="at most 5: --max-loops"):
        capped.check(Request([5], greedy(2), loops=6))


def test_a_seed_outside_64_bits_is_refused_before_any_work():
    with pytest.raises(ConfigError, match="must be a 64-bit integer"):
        Sampling(seed=1180591620717411303424)
    Sampling(seed=2 ** 64 - 1)
    Sampling(seed=-2 ** 63)


@pytest.mark.parametrize("exit", [None, E("state:0.2")])
def test_a_deep_request_spreads_its_token_over_boundaries_and_decodes_as_alone(exit):
    """loops=12 on a model trained at 3 (loop_slice 3): while ordinary rows decode, the deep
    request's prefill and steps run 3 loop steps a boundary, so they get a token at every boundary
    and it one every 4 loop slices; a deep newcomer arriving meanwhile prefills alongside and joins;
    every row decodes what it decodes alone."""
    model = build(tiny(spec="1+1R3+1"))
    batcher = Batcher(model, eos_id=0, pad_id=1)
    plain = [Request(PROMPTS[i], greedy(16)) for i in (0, 1)]
    deep = Request(PROMPTS[2], greedy(4), loops=12, exit=exit)
    late = Request(PROMPTS[3], greedy(3), loops=12, exit=exit)
    for r in [*plain, deep]:
        batcher.submit(r)
    batcher.step()  # admission: each gets its first token
    counts = []
    for boundary in range(8):
        if boundary == 1:
            batcher.submit(late)  # the deep cohort is one slice into its step
        batcher.step()
        counts.append((len(plain[0].tokens), len(deep.tokens)))
    assert [c[0] for c in counts] == list(range(3, 11))  # a token at every boundary
    # its prefill is sliced too: the first boundary ran a quarter of it, so its first token comes
    # 3 boundaries later, then one every 3 (the step's first slice shares the prefill's boundary)
    if exit is None:  # (under exit its tokens may stop looping early: fewer boundaries)
        assert [c[1] for c in counts] == [0, 0, 1, 1, 1, 2, 2, 2]
    while batcher.step():
        pass
    for r in [*plain, deep, late]:
        assert r.tokens == reference(model, r) and r.finish == "length"


@pytest.mark.parametrize("loops", [5, 7])  # not a multiple of the slice: the last one is shorter
def test_deep_requests_whose_loops_the_slice_does_not_divide_decode_as_alone(loops):
    model = build(tiny(spec="1+1R3+1"))
    batcher = Batcher(model, eos_id=0, pad_id=1)
    rs = [Request(PROMPTS[0], greedy(10)), Request(PROMPTS[2], greedy(5), loops=loops),
          Request(PROMPTS[4], greedy(5), loops=loops, exit=E("state:0.2"))]
    staggered(batcher, rs, every=1)
    assert [r.tokens for r in rs] == [reference(model, r) for r in rs]


def test_alone_a_deep_request_is_not_sliced_and_loop_slice_0_never_slices():
    model = build(tiny(spec="1+1R3+1"))
    for batcher, plain in [(Batcher(model, eos_id=0, pad_id=1), []),
                           (Batcher(model, eos_id=0, pad_id=1, loop_slice=0),
                            [Request(PROMPTS[0], greedy(8))])]:
        deep = Request(PROMPTS[2], greedy(4), loops=12)
        for r in [*plain, deep]:
            batcher.submit(r)
        for _ in range(4):
            batcher.step()
        assert len(deep.tokens) == 4


def test_a_deep_request_cancelled_mid_slice_leaves_when_the_slice_ends():
    model = build(tiny(spec="1+1R3+1"))
    batcher = Batcher(model, eos_id=0, pad_id=1)
    plain, deep = Request(PROMPTS[0], greedy(12)), Request(PROMPTS[2], greedy(6), loops=12)
    for r in (plain, deep):
        batcher.submit(r)
    batcher.step()  # the deep prefill is a quarter done
    batcher.cancel(deep)
    for _ in range(4):
        batcher.step()
    assert deep.finish == "cancelled" and not deep.tokens and batcher.running == 1
    while batcher.step():
        pass
    assert plain.tokens == reference(model, plain)


def _compiled_serving_decodes_as_eager_alone(scheme):
    model = build(tiny(scheme=scheme, spec="1+2+1+1" if scheme == "vanilla" else "1+1R3+1"))
    batcher = Batcher(model, eos_id=0, pad_id=1, max_batch=4, compile=True)
    assert batcher.warm().startswith("compiled the decode step")
    batcher.compile = True  # whatever the timing chose: the compiled path is what is checked
    rs = requests()
    staggered(batcher, rs)
    # fp32: Inductor's fused ops round apart from eager's, not enough to flip a greedy token here
    assert [r.tokens for r in rs] == [reference(model, r) for r in rs]
    assert batcher.stats.step_rows > batcher.stats.steps  # they did share batches


def test_compiled_serving_joins_and_leaves_in_one_graph_and_decodes_as_alone(traced_only,
                                                                            monkeypatch):
    """`meshlm serve --compile`: rows joining and leaving a batch whose whole steps run as one
    traced graph (symbolic batch size and cache length, no graph break; the warm-up compiles every
    graph serving then needs) decode exactly what eager meshlm.generate decodes for each alone."""
    model = build(tiny(scheme="mesh", spec="1+1R3+1"))
    batcher = Batcher(model, eos_id=0, pad_id=1, max_batch=4, compile=True)
    batcher.warm()
    batcher.compile = True  # whatever the timing chose: the compiled path is what is checked
    graphs = traced_only["stats"]["unique_graphs"]
    assert not traced_only["graph_break"]
    assert graphs == 3, graphs  # several rows (specialised, then general) and one row alone
    compiled_steps = []  # the compiled path (and only it) reserves cache room before a step
    reserve = KVCache.reserve
    monkeypatch.setattr(KVCache, "reserve", lambda kv, t: (compiled_steps.append(t),
                                                           reserve(kv, t)))
    rs = requests()
    staggered(batcher, rs)
    assert [r.tokens for r in rs] == [reference(model, r) for r in rs]
    assert batcher.stats.step_rows > batcher.stats.steps
    assert len(compiled_steps) == batcher.stats.steps  # every step of serving ran compiled
    assert traced_only["stats"]["unique_graphs"] == graphs  # and compiled nothing new


def test_compiled_serving_decodes_exit_requests_eagerly(traced_only):
    """`meshlm serve --compile` keeps exit requests' steps eager (PlainDecoder: compiled, their
    pieces would compile while serving, for no faster a step): nothing is traced after the warm-up,
    and each request's tokens are eager meshlm.generate's, tokens exiting early in the batch."""
    model = build(tiny(scheme="mesh", spec=f"1+1R{LOOPS}+1"))
    rule = E(f"state:{mid_threshold(model, x_batch(), 'state')}")
    batcher = Batcher(model, eos_id=0, pad_id=1, max_batch=4, compile=True)
    batcher.warm()
    batcher.compile = True  # whatever the timing chose
    graphs = traced_only["stats"]["unique_graphs"]
    rs = requests(exit=rule)
    staggered(batcher, rs, every=1)
    assert [r.tokens for r in rs] == [reference(model, r) for r in rs]
    assert traced_only["stats"]["unique_graphs"] == graphs
    assert batcher.stats.loop_steps < LOOPS * batcher.stats.decoded


@pytest.mark.parametrize("compiled_ms, keeps", [(2.0, True), (5.0, False)])
def test_the_compiled_step_is_kept_only_where_the_warm_up_times_it_faster(monkeypatch, compiled_ms,
                                                                          keeps):
    import meshlm.serve.batcher as batcher_module

    monkeypatch.setattr(batcher_module, "warm", lambda model, pad_id, rows: (9.0, compiled_ms, 3.0))
    batcher = Batcher(build(tiny()), eos_id=0, pad_id=1, max_batch=4, compile=True)
    line = batcher.warm()
    assert batcher.compile is keeps
    assert f"{compiled_ms:.1f} ms compiled, 3.0 ms eager" in line
    assert ("decoding compiled" in line) is keeps
    assert Batcher(build(tiny()), eos_id=0, pad_id=1).warm() == ""  # without --compile: nothing


@pytest.mark.slow
@pytest.mark.parametrize("scheme", [*LOOPED, "vanilla"])
def test_compiled_serving_decodes_as_eager_alone(scheme):
    """The same through Inductor, every scheme: greedy tokens equal eager's."""
    _compiled_serving_decodes_as_eager_alone(scheme)
