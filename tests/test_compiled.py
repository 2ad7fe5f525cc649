"""Plain decoding through one compiled step over a static looped KV cache
(meshlm.generate.compiled): the static cache computes what the growing one does, for every scheme
and with left padding; compiled, the greedy tokens are the eager decoder's; what it cannot do is
refused in one line."""
from unittest.mock import patch

import pytest
import torch
from conftest import build, tiny
from test_exit import mid_threshold, x_batch
from test_memory import randomise_routers

from meshlm.checkpoint import save_model
from meshlm.cli import main
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import ConfigError
from meshlm.generate import PlainDecoder, Sampling, decode, generate, left_pad, next_token
from meshlm.generate.compiled import COLUMNS, CompiledDecoder, capacity_for
from meshlm.generate.speculative import Speculation, SpeculationStats
from meshlm.model.exit import ExitRule
from meshlm.model.kv_cache import StaticKVCache

SCHEMES = ["mesh", "base", "anchor"]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]  # left padding in the batch


def logits_by_step(decoder, model, s, prompts=PROMPTS):
    """Every decode step's (B, V) logits, decoder.forward observed."""
    seen, inner = [], decoder.forward

    def spy(*args):
        out = inner(*args)  # (logits, loop steps)
        seen.append(out[0])
        return out
    decoder.forward = spy
    ids, mask = left_pad(prompts, 1, torch.device("cpu"))
    list(decode(decoder, decoder.prefill(ids, mask), s))
    return seen


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_static_cache_computes_what_the_growing_one_does(scheme):
    model = build(tiny(scheme=scheme, spec="1+2R3+1", vocab_size=128, context_length=96))
    s = Sampling(max_new_tokens=8, temperature=0, stop_at_eos=False)

    def choose(logits):
        return next_token(logits, s, None)
    with torch.no_grad():
        static = CompiledDecoder(model, model.schedule(), choose, s.max_new_tokens, compiled=False)
        steps = logits_by_step(static, model, s)
        assert static.cache.capacity == COLUMNS and static.cache.column == 5 + 7
        plain = PlainDecoder(model, model.schedule(), choose,
                             observe=lambda out, mask: eager.append(out.logits[:, -1]))
        eager = []
        ids, mask = left_pad(PROMPTS, 1, torch.device("cpu"))
        tokens = [t.tolist() for t in decode(plain, plain.prefill(ids, mask), s)]
    assert len(steps) == len(eager) - 1 == 7  # the prefill's logits come first
    for ours, theirs in zip(steps, eager[1:]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert generate(model, PROMPTS, s) == [list(row) for row in zip(*tokens)]


class Loops:
    """What `decode` records of every step (its `stats`): the loop steps its tokens ran."""

    tokens = seconds = 0
    loop_steps = 0

    def record(self, step):
        self.loop_steps += step.loop_steps


def exiting(scheme: str, criterion: str):
    """A tiny looped model of `scheme` and an exit rule of `criterion` that splits its tokens after
    the first loop step (tests/test_exit.py's threshold)."""
    model = build(tiny(scheme=scheme, spec="1+1R4+1", vocab_size=128, context_length=96))
    if scheme == "mesh":
        randomise_routers(model)  # far from uniform: tokens converge at different steps
    return model, ExitRule.parse(f"{criterion}:{mid_threshold(model, x_batch(t=12), criterion)}")


# kl on the anchor scheme is left out: its tiny model's step-to-step KL is ~1e-7, where the static
# cache's attention (rounded apart from the growing cache's) can move a token across τ
@pytest.mark.parametrize("scheme,criterion", [(scheme, "state") for scheme in SCHEMES] +
                         [("mesh", "kl"), ("base", "kl")])
def test_the_static_cache_decodes_exit_as_the_growing_one(scheme, criterion):
    """Per-token exit over the static cache (run eagerly): the growing cache's tokens and loop
    steps, alone and with left padding in a batch, and tokens did exit early."""
    model, rule = exiting(scheme, criterion)
    s = Sampling(max_new_tokens=10, temperature=0, stop_at_eos=False)

    def choose(logits):
        return next_token(logits, s, None)
    for prompts in (PROMPTS[:1], PROMPTS):
        ran = {}
        for name, decoder in (("static", CompiledDecoder(model, model.schedule(), choose, 10,
                                                         compiled=False, exit=rule)),
                              ("growing", PlainDecoder(model, model.schedule(), choose, rule))):
            ids, mask = left_pad(prompts, 1, torch.device("cpu"))
            loops = Loops()
            with torch.no_grad():
                tokens = [t.tolist() for t in decode(decoder, decoder.prefill(ids, mask), s,
                                                     stats=loops)]
            ran[name] = tokens, loops.loop_steps
        assert ran["static"] == ran["growing"]
        assert ran["static"][1] < 4 * 9 * len(prompts)  # some of the 9 steps' tokens exited


@pytest.mark.parametrize("criterion", ["state", "kl"])
def test_exit_compiles_in_pieces_and_decodes_the_eager_tokens(traced_only, criterion):
    """`generate --compile --exit`: the step's decisions break it into traced pieces, none of
    which falls back to eager decoding for hitting the recompile limit (which here raises); the
    eager exit's tokens, alone and in a batch."""
    model, rule = exiting("mesh", criterion)
    s = Sampling(max_new_tokens=10, temperature=0, stop_at_eos=False)
    for prompts in (PROMPTS[:1], PROMPTS):
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            compiled_tokens = generate(model, prompts, s, exit=rule, compile=True)
        assert compiled_tokens == generate(model, prompts, s, exit=rule)
    assert traced_only["graph_break"] and traced_only["stats"]["unique_graphs"] > 1


def test_a_step_attends_over_its_window_and_one_graph_serves_every_width(traced_only):
    """The static cache's steps read the columns filled so far, rounded up to COLUMNS (with the
    query's empty nominal column last), not the whole capacity: widths 128 and 192 (the whole
    capacity) after 120-token prompts, through one traced graph, the eager decoder's tokens (12
    of them, as the other compiled tests: few steps for a near-tie to flip)."""
    model = build(tiny(spec="1+1R2+1", scheme="mesh", vocab_size=128, context_length=256))
    s = Sampling(max_new_tokens=12, temperature=0, stop_at_eos=False)
    prompts = [[5 + i % 100 for i in range(120)], [7 + i % 90 for i in range(117)]]  # left-padded
    assert generate(model, prompts, s, compile=True) == generate(model, prompts, s)
    assert traced_only["stats"]["unique_graphs"] == 1
    widths, update = set(), StaticKVCache.update

    def spy(cache, key, value, layer_idx):  # the same step run eagerly, every width seen
        keys, values = update(cache, key, value, layer_idx)
        assert keys.shape[-2] == values.shape[-2] == cache.get_seq_length() + 1
        assert cache.column + 2 <= keys.shape[-2] <= cache.capacity
        widths.add(keys.shape[-2])
        return keys, values
    static = CompiledDecoder(model, model.schedule(), lambda logits: next_token(logits, s, None),
                             s.max_new_tokens, compiled=False)
    with patch.object(StaticKVCache, "update", spy), torch.no_grad():
        logits_by_step(static, model, s, prompts)
    assert widths == {2 * COLUMNS, 3 * COLUMNS} == {128, 192}
    assert static.cache.capacity == 3 * COLUMNS  # the last window is the whole capacity, and
    assert static.cache.k0.shape[-2] == 3 * COLUMNS + 1  # the spare column is never attended


def test_capacity_rounds_up_and_a_full_context_is_refused():
    assert capacity_for(5, 8) == COLUMNS and capacity_for(COLUMNS - 1, 1) == 2 * COLUMNS
    model = build(tiny(vocab_size=128, context_length=32))
    s = Sampling(max_new_tokens=32 - 5, temperature=0, stop_at_eos=False)
    with pytest.raises(ConfigError, match="one column beyond the prompt and the new tokens"):
        generate(model, [[5, 6, 7, 8, 9]], s, compile=True)


def test_what_compile_cannot_do_is_refused_in_one_line(tmp_path, capsys):
    model = build(tiny(vocab_size=8192))
    s = Sampling(max_new_tokens=2, temperature=0)
    with pytest.raises(ConfigError, match="--compile decodes with the KV cache"):
        generate(model, [[5]], s, cache=False, compile=True)
    for plain_only in (dict(exit=ExitRule.parse("state:0.1")),
                       dict(speculate=Speculation.parse("auto"))):
        with pytest.raises(ConfigError, match="use --compile with --exit or --speculate"):
            generate(model, [[5]], s, compile="aot", **plain_only)
    save_model(model, tmp_path / "ckpt")
    refused = [(flag, ["--no-cache"], "--compile decodes with the KV cache")
               for flag in ("--compile", "--aot")]
    refused += [("--aot", extra, "use --compile with --exit or --speculate")
                for extra in (["--exit", "state:0.1"], ["--speculate", "auto"])]
    for flag, extra, why in refused:
        assert main(["generate", str(tmp_path / "ckpt"), "To be", flag, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0]
    # the prompt and -n fill the context exactly: eager decoding fits, the compiled step's extra
    # column does not; refused before anything is printed
    n = model.config.context_length - len(load_tokenizer("default").encode("To be"))
    assert main(["generate", str(tmp_path / "ckpt"), "To be", "-n", str(n), "--compile"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "one column beyond the prompt and the new tokens" in err


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_one_query_attention_is_sdpas(heads, kv_heads):
    # what a compiled CPU step attends with (meshlm.model.layers.one_query): grouped-query heads,
    # no mask, a per-row mask and one mask broadcast over the batch
    from meshlm.model.layers import one_query
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, heads, 1, 16, generator=g)
    k, v = (torch.randn(3, kv_heads, 37, 16, generator=g) for _ in range(2))
    rows = torch.rand(3, 1, 1, 37, generator=g) > 0.4
    rows[..., -1] = True  # the query's own column
    for mask in (None, rows, rows[:1]):
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
        torch.testing.assert_close(one_query(q, k, v, mask), expected, rtol=1e-5, atol=1e-6)
    # bf16 inputs: summed in fp32 as SDPA's CPU kernel sums them, so no further from fp32's result
    low = [t.bfloat16() for t in (3 * q, 3 * k, v)]  # larger scores: rounding them shows
    exact = torch.nn.functional.scaled_dot_product_attention(
        *(t.float() for t in low), enable_gqa=heads != kv_heads)
    ours = one_query(*low, None)
    sdpa = torch.nn.functional.scaled_dot_product_attention(*low, enable_gqa=heads != kv_heads)
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - exact).abs().max() <= (sdpa.float() - exact).abs().max() + 2**-8


@pytest.mark.slow
@pytest.mark.parametrize("scheme", [*SCHEMES, "vanilla", "llama"])
def test_compiled_greedy_tokens_are_the_eager_decoders(scheme):
    spec = "1+2+1" if scheme == "vanilla" else "1+2R3+1"
    # llama: grouped-query heads through the compiled step's one-query attention
    extra = dict(backbone="llama", n_kv_heads=2) if scheme == "llama" else dict(scheme=scheme)
    model = build(tiny(spec=spec, d_model=64, vocab_size=256, context_length=96, **extra))
    s = Sampling(max_new_tokens=12, temperature=0, stop_at_eos=False)
    eager = generate(model, PROMPTS, s)
    assert generate(model, PROMPTS, s, compile=True) == eager
    assert generate(model, PROMPTS, s, compile=True) == eager  # the compiled step reused


@pytest.mark.parametrize("speculate", ["1:3"])  # auto's plain steps: the CLI test below
def test_speculation_through_compiled_stages_decodes_plain_greedy(traced_only, speculate):
    """`generate --compile --speculate`: the rounds' stages (and plain steps) run traced, the
    prefill eagerly; the tokens are plain greedy decoding's and no frame hits the recompile limit;
    with a fixed setting rounds did run and a second generation traces nothing new (auto's
    choices follow measured costs, so a second run may take another path)."""
    model = build(tiny(scheme="mesh", spec="1+1R3+1", vocab_size=128, context_length=96))
    s = Sampling(max_new_tokens=12, temperature=0, stop_at_eos=False)
    stats = SpeculationStats()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        tokens = generate(model, PROMPTS, s, speculate=Speculation.parse(speculate), stats=stats,
                          compile=True)
        graphs = traced_only["stats"]["unique_graphs"]
        again = generate(model, PROMPTS, s, speculate=Speculation.parse(speculate), compile=True)
    assert tokens == again == generate(model, PROMPTS, s)
    assert graphs > 0
    if speculate != "auto":
        assert stats.rounds > 0 and traced_only["stats"]["unique_graphs"] == graphs


def test_a_prompt_through_the_compiled_stages_breaks_no_graph(traced_only):
    """Several tokens with no past and no padding (a prefill) through steps.CompiledStages, their
    length symbolic: each stage traces whole (SDPA is told `is_causal` as a bool, where the length
    comparison had been a SymBool it refused, breaking the graph), for two lengths, and the
    logits are the eager model's."""
    from meshlm.generate.steps import CompiledStages
    from meshlm.model.kv_cache import KVCache
    model = build(tiny(scheme="mesh", spec="1+1R2+1", vocab_size=128, context_length=96))
    stages, schedule = CompiledStages(model), model.schedule()

    def logits(runner, ids):
        run = runner.start(ids, None, KVCache())
        return runner.readout(runner.advance(run, schedule), schedule)
    with torch.no_grad():
        for n in (5, 7):
            ids = torch.randint(0, 128, (2, n), generator=torch.Generator().manual_seed(n))
            torch.testing.assert_close(logits(stages, ids), logits(model, ids))
    assert traced_only["graph_break"] == {}


@pytest.mark.slow
def test_compiled_exit_decodes_the_eager_tokens():
    """The same through Inductor: greedy tokens equal eager exit's, in a left-padded batch (the
    masked rows; a batch of one compiled cold costs another 30 s, and the traced test has it)."""
    model, rule = exiting("mesh", "state")
    s = Sampling(max_new_tokens=10, temperature=0, stop_at_eos=False)
    assert generate(model, PROMPTS, s, exit=rule, compile=True) == \
        generate(model, PROMPTS, s, exit=rule)


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--compile", "--aot"])  # --aot: meshlm.generate.ahead
def test_meshlm_generate_compile_prints_the_eager_text(flag, tmp_path, capsys, monkeypatch):
    from meshlm.generate import ahead

    monkeypatch.setattr(ahead, "cache_dir", lambda: tmp_path / "cache")  # its libraries
    save_model(build(tiny(vocab_size=8192)), tmp_path / "ckpt")
    outputs = []
    for extra in ([], [flag]):
        assert main(["generate", str(tmp_path / "ckpt"), "To be, or not", "-t", "0", "-n", "8",
                     *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]


def test_meshlm_generate_compile_exit_prints_the_eager_text_and_no_warning(traced_only, tmp_path,
                                                                          capfd):
    """`meshlm generate --compile --exit`: the eager text; stderr holds the precision line alone
    (not torch's warning about the graph breaks exit's decisions make)."""
    import logging

    save_model(build(tiny(vocab_size=8192, spec="1+1R3+1")), tmp_path / "ckpt")
    outputs, warned = [], []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warned.append
    torch_warnings = logging.getLogger("torch._dynamo.variables.tensor")
    torch_warnings.addHandler(handler)
    try:
        for extra in ([], ["--compile"]):
            assert main(["generate", str(tmp_path / "ckpt"), "To be", "-t", "0", "-n", "6",
                         "--exit", "state:0.3", *extra]) == 0
            out, err = capfd.readouterr()
            outputs.append(out)
            assert [line[:13] for line in err.strip().splitlines()] == ["generated in "]
    finally:
        torch_warnings.removeHandler(handler)
    assert outputs[0] == outputs[1] and traced_only["graph_break"] and not warned


def test_meshlm_generate_compile_speculate_prints_the_eager_text(traced_only, tmp_path, capsys):
    """`meshlm generate --compile --speculate auto`: the text of eager plain decoding, the
    speculation line on stderr, and no race (the planner times the compiled stages itself); a
    prompt and -n that fill the context exactly are not refused (the growing cache needs no
    extra column)."""
    model = build(tiny(vocab_size=8192, spec="1+1R3+1"))
    save_model(model, tmp_path / "ckpt")
    n = model.config.context_length - len(load_tokenizer("default").encode("To be"))
    assert main(["generate", str(tmp_path / "ckpt"), "To be", "-t", "0", "-n", str(n),
                 "--speculate", "auto", "--compile"]) == 0
    capsys.readouterr()
    outputs = []
    for extra in ([], ["--speculate", "auto", "--compile"]):
        assert main(["generate", str(tmp_path / "ckpt"), "To be", "-t", "0", "-n", "10",
                     *extra]) == 0
        out, err = capsys.readouterr()
        outputs.append(out)
    assert outputs[0] == outputs[1] and traced_only["stats"]["unique_graphs"] > 0
    assert err.startswith("speculate: ") and "decode step compiled" not in err


@pytest.mark.parametrize("compiled_ms, kept", [(0.5, True), (2.0, False)])
def test_generate_compile_decodes_compiled_only_where_the_race_finds_it_faster(
        traced_only, tmp_path, capsys, monkeypatch, compiled_ms, kept):
    """`meshlm generate --compile` races the compiled step against the eager one (compiled.race)
    and decodes compiled only where it was faster; the text is the same either way, and the
    precision line gives both figures and the choice."""
    from meshlm.generate import compiled

    real_race, raced = compiled.race, []

    def race(*args, **kwargs):  # the real race (its throwaway steps), then the figures given
        raced.append(real_race(*args, **kwargs))
        return {**raced[-1], "compiled_ms": compiled_ms, "eager_ms": 1.0}
    monkeypatch.setattr(compiled, "race", race)
    stepped, step = [], CompiledDecoder.step
    monkeypatch.setattr(CompiledDecoder, "step",
                        lambda *a, **k: (stepped.append(1), step(*a, **k))[1])
    save_model(build(tiny(vocab_size=8192)), tmp_path / "ckpt")
    outputs = []
    for extra in ([], ["--compile"]):
        assert main(["generate", str(tmp_path / "ckpt"), "To be", "-t", "0", "-n", "12",
                     *extra]) == 0
        out, err = capsys.readouterr()
        outputs.append(out)
    assert outputs[0] == outputs[1]
    (line,) = [x for x in err.splitlines() if x.startswith("generated in")]
    assert f": {compiled_ms:.2f} ms a step against 1.00 eager, so decoded " in line
    assert line.endswith("compiled" if kept else "eagerly (compiling does not pay here)")
    race_steps = (1 + compiled.RACE_ROUNDS) * compiled.RACE_STEPS
    assert len(raced) == 1 and raced[0]["compiled_ms"] > 0 and raced[0]["eager_ms"] > 0
    assert len(stepped) == race_steps + (11 if kept else 0)  # the 11 steps after the prefill's


def test_a_compiled_generation_names_kernels_reached_through_python_operators(
        traced_only, tmp_path, capsys, monkeypatch):
    """Where operators.cpp could not be had, the precision line says so and why, with --compile
    only (eager decoding calls the kernels by ctypes either way)."""
    from meshlm.kernels import operators

    monkeypatch.setattr(operators, "unavailable", lambda: "no C++ compiler on PATH (…)")
    save_model(build(tiny(vocab_size=8192)), tmp_path / "ckpt")
    for extra in ([], ["--compile"]):
        assert main(["generate", str(tmp_path / "ckpt"), "To be", "-t", "0", "-n", "2",
                     *extra]) == 0
        (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("generated in")]
        assert line.endswith("; the compiled step calls its kernels through Python operators "
                             "(no C++ compiler on PATH (…))") == bool(extra)
