"""Elastic depth in training: loop-count sampling (train.loops) and truncated backprop
(train.backprop_loops)."""
import shutil

import numpy as np
import pytest
import torch
from conftest import build, tiny
from trainkit import make_prepared, run_dir, tiny_train, train_losses

from meshlm.errors import ConfigError
from meshlm.train.depth import parse_loops
from meshlm.train.trainer import train


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return make_prepared(tmp_path_factory)


# -- the sampler -----------------------------------------------------------------------------------
def test_fixed_draws_the_model_default_and_fixed_n_draws_n():
    assert parse_loops("fixed").draw(0, 5) is None and parse_loops("fixed").cap(3) == 3
    assert parse_loops("fixed:6").draw(0, 5) == 6 and parse_loops("fixed:6").cap(2) == 6


def test_counts_depend_only_on_seed_and_step():
    """What every rank and every resumed process computes: no global RNG state enters the draw."""
    dist = parse_loops("poisson-lognormal:mean=4,cap=16")
    first = [dist.draw(7, s) for s in range(50)]
    torch.manual_seed(123)
    np.random.seed(9)
    assert [dist.draw(7, s) for s in range(50)] == first
    assert [dist.draw(8, s) for s in range(50)] != first


def test_poisson_lognormal_has_its_mean_and_respects_the_cap():
    counts = np.array([parse_loops("poisson-lognormal:mean=4,cap=64").draw(0, s)
                       for s in range(4000)])
    assert counts.min() >= 1 and counts.max() <= 64 and abs(counts.mean() - 4) < 0.15
    capped = [parse_loops("poisson-lognormal:mean=4,cap=6").draw(0, s) for s in range(500)]
    assert max(capped) == 6


def test_uniform_covers_its_range():
    counts = {parse_loops("uniform:2-5").draw(1, s) for s in range(200)}
    assert counts == {2, 3, 4, 5}


@pytest.mark.parametrize("text, needle", [
    ("gaussian:4",
     "is not a loop distribution; use fixed, fixed:N, uniform:LO-HI or poisson-lognormal"),
    ("uniform:5-2", "is not a loop distribution"),
    ("poisson-lognormal:mean=4", "is not a loop distribution"),
    ("poisson-lognormal:mean=8,cap=4", "cap=4 is below mean=8; the cap must be >= the mean"),
    ("fixed:0", "counts >= 1"),
])
def test_malformed_distributions_are_one_line_errors(text, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        parse_loops(text)


def test_backprop_loops_above_the_cap_and_multi_core_sampling_are_errors(prepared, tmp_path):
    with pytest.raises(ConfigError, match="backprop_loops=9 is above the largest loop count 8"):
        tiny_train(prepared, tmp_path, loops="uniform:1-8", backprop_loops=9)
    with pytest.raises(ConfigError, match="backprop_loops=3 is above the largest loop count 2"):
        tiny_train(prepared, tmp_path, backprop_loops=3)
    with pytest.raises(ConfigError, match="needs a single-core spec"):
        tiny_train(prepared, tmp_path,
                   model={"preset": "tiny", "vocab_size": 8192, "spec": "1+1+1+1"},
                   loops="uniform:1-4")


def test_sampling_gives_per_step_parameters_up_to_the_distributions_95th_percentile(prepared,
                                                                                    tmp_path):
    assert tiny_train(prepared, tmp_path, loops="uniform:1-8").derive_model().max_loops == 8
    # mean 4, cap 16: 95% of draws are <= 8 (P(n >= 12) is 1%): pairs beyond 8 would hardly be
    # trained
    huginn = tiny_train(prepared, tmp_path, loops="poisson-lognormal:mean=4,cap=16")
    assert huginn.derive_model().max_loops == 8
    draws = [huginn.loop_distribution().draw(0, step) for step in range(4000)]
    assert 0.94 <= sum(n <= 8 for n in draws) / len(draws) <= 0.97 and max(draws) > 8
    within_k = tiny_train(prepared, tmp_path, loops="uniform:1-2")
    assert within_k.derive_model().max_loops is None  # within K
    assert tiny_train(prepared, tmp_path).derive_model().max_loops is None  # fixed: today's model
    explicit = tiny_train(prepared, tmp_path, loops="uniform:1-4",
                          model={"preset": "tiny", "vocab_size": 8192, "max_loops": 6})
    assert explicit.derive_model().max_loops == 6


# -- training with sampled counts ------------------------------------------------------------------
def test_mfu_of_sampled_and_truncated_depth_counts_the_drawn_loops(prepared, tmp_path):
    """MFU = tokens/s x the mean training FLOPs per token of the steps run, each at its drawn loop
    count (forward at the drawn count, backward over the last backprop_loops passes), not at the
    spec's K."""
    from meshlm.model import MeshLM
    from meshlm.model.accounting import describe, train_flops_per_token

    cfg = tiny_train(prepared, tmp_path, steps=6, save_every=0, loops="uniform:1-6",
                     backprop_loops=2,
                     peak_flops=1e11)
    result = train(cfg, log=lambda m: None)
    drawn = [parse_loops(cfg.loops).draw(0, s) for s in range(6)]
    with torch.device("meta"):
        model = MeshLM(cfg.derive_model())
    mean = np.mean([train_flops_per_token(model, k, 2, cfg.seq_len) for k in drawn])
    assert result.mfu == pytest.approx(result.tokens_per_s * mean / 1e11, rel=1e-9)
    spec_k = describe(cfg.derive_model(), cfg.seq_len).train_flops_per_token
    assert mean != pytest.approx(spec_k)  # the figure the MFU used to divide by


def test_sampled_training_logs_the_drawn_counts_and_resumes_bit_exactly(prepared, tmp_path):
    common = dict(steps=8, save_every=4, loops="poisson-lognormal:mean=2,cap=5", backprop_loops=2)
    ref = train(tiny_train(prepared, tmp_path / "ref", **common), log=lambda m: None)
    cfg = tiny_train(prepared, tmp_path / "cut", **common)
    train(cfg, log=lambda m: None)
    shutil.rmtree(run_dir(cfg) / "step-000008")  # as if killed after the step-4 checkpoint
    resumed = train(cfg, resume=True, log=lambda m: None)
    assert resumed.start_step == 4
    assert train_losses(run_dir(cfg)) == train_losses(ref.run_dir)
    import json
    lines = [json.loads(x) for x in (ref.run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [x["loops"] for x in lines if x.get("kind") == "train"]
    dist = parse_loops(common["loops"])
    assert logged == [dist.draw(0, s) for s in range(8)] and len(set(logged)) > 1


# -- truncated backprop ----------------------------------------------------------------------------
def reference_grads(model, x, y, loops, k):
    """The loop written out with every step under autograd, detaching the carried state (h and the
    scheme's written values/coefficients) where truncated backprop starts; e, p and h⁰ keep their
    gradients."""
    model.zero_grad()
    e, rope, mask = model._prepare(x, None, None, None)
    from meshlm.model.schemes import LoopContext

    ctx = LoopContext(e=e)
    h = model.scheme.begin(ctx, model.prelude(e, rope, mask))
    written = len(ctx.values)
    for step in range(loops):
        # k = loops: no pass runs without autograd, nothing is cut
        if step == loops - k and step > 0:
            h = h.detach()
            ctx.values = ctx.values[:written] + [v.detach() for v in ctx.values[written:]]
            if ctx.coefficients is not None:
                ctx.coefficients = ctx.coefficients.detach()
        h = model.scheme.update(step, h, model.cores[0](h, rope, mask), ctx)
    logits = torch.nn.functional.linear(model.final_layer_norm(model.coda(h, rope, mask)),
                                        model.output_weight)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("scheme, options",
                         [("mesh", {}), ("mesh", {"slots": 2}), ("anchor", {}), ("base", {}),
                          ("dynamic-mix", {})])
def test_truncated_backprop_equals_detaching_at_the_same_point(scheme, options):
    """With 2 slots MeSH folds the no-grad steps' values into its slots (MeSH.truncate): still
    exact."""
    model = build(tiny(scheme=scheme, scheme_options=options, max_loops=6),
                  dtype=torch.float64).train()
    x = torch.randint(0, 97, (2, 9))
    y = torch.roll(x, -1, 1)
    for loops, k in [(5, 2), (4, 1), (3, 3)]:
        expected = reference_grads(model, x, y, loops, k)
        model.zero_grad()
        model(x, targets=y, loops=loops, backprop_loops=k).loss.backward()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == expected.keys()
        for name in got:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-9, atol=1e-12, msg=name)
    # routers of the no-grad steps get nothing; the last k pairs do
    if scheme == "mesh" and not options:
        model.zero_grad()
        model(x, targets=y, loops=5, backprop_loops=2).loss.backward()
        assert (model.scheme.routers[1].weight.grad is None
                and model.scheme.routers[5].weight.grad is not None)
