"""fp32 decoding's weight layout (meshlm.runtime.split_linear): a SplitLinear computes what its
nn.Linear computes, to fp32 rounding, for any row count, block count and shape, and a model decoded
with split layers makes the same greedy tokens, cached, uncached and under speculation."""
import copy

import pytest
import torch
from conftest import build, tiny

from meshlm import machine
from meshlm.decoding import for_decoding
from meshlm.generate import Sampling, generate
from meshlm.generate.speculative import Speculation
from meshlm.model.memory import Router
from meshlm.runtime import split_linear
from meshlm.runtime.split_linear import (
    MIN_BLOCK,
    SharedSplitLinear,
    SplitLinear,
    parts_for,
    split_linears,
    split_tied_head,
)


@pytest.mark.parametrize("out_features, in_features, bias", [(96, 40, True), (1000, 33, False),
                                                             (7, 5, True)])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_a_split_layer_computes_its_linear(out_features, in_features, bias, parts):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    split = SplitLinear.of(linear, parts)
    assert split.blocks.shape == (parts, in_features, -(-out_features // parts))
    for shape in ((1, in_features), (5, in_features), (2, 3, in_features), (300, in_features)):
        x = torch.randn(shape)
        y = split(x)
        assert y.shape == (*shape[:-1], out_features)
        torch.testing.assert_close(y, linear(x), rtol=1e-6, atol=1e-6)


def test_a_layer_gets_one_block_per_thread_but_none_narrower_than_the_minimum():
    assert parts_for(4 * MIN_BLOCK, 2) == 2 and parts_for(4 * MIN_BLOCK, 8) == 4
    assert parts_for(MIN_BLOCK - 1, 2) == 1 and parts_for(50304, 1) == 1


def test_only_plain_fp32_linears_are_split():
    model = build(tiny(spec="1+1R2+1", scheme="mesh", vocab_size=256))
    plain = sum(type(m) is torch.nn.Linear for m in model.modules())
    routers = sum(isinstance(m, Router) for m in model.modules())
    assert routers > 0  # MeSH's routers are nn.Linear subclasses with their own forward
    assert split_linears(model, threads=2) == plain
    assert sum(isinstance(m, Router) for m in model.modules()) == routers
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    bf16 = build(tiny()).to(torch.bfloat16)
    assert split_linears(bf16, threads=2) == 0


@pytest.mark.parametrize("cfg", [tiny(spec="1+1R3+1", scheme="mesh", vocab_size=256),
                                 tiny(spec="1+2R2+1", backbone="llama", tie_embeddings=True,
                                      vocab_size=256),
                                 tiny(spec="1+1R2+1", backbone="olmoe", scheme="mesh",
                                      n_kv_heads=2, n_experts=4, top_k=2, mlp_hidden=16,
                                      vocab_size=256)])
def test_split_decoding_makes_the_same_tokens_every_way(cfg):
    model = build(cfg)
    split = copy.deepcopy(model)
    split_linears(split, threads=2)
    assert split_tied_head(split, threads=2) == cfg.tie_embeddings
    prompts, s = [[3, 4, 5, 6], [9, 2]], Sampling(max_new_tokens=12, temperature=0,
                                                  stop_at_eos=False)
    reference = generate(model, prompts, s)
    assert generate(split, prompts, s) == reference
    assert generate(split, prompts, s, cache=False) == reference
    assert generate(split, prompts, s, speculate=Speculation(1, 3)) == reference
    ids = torch.tensor(prompts[0])[None]
    with torch.no_grad():
        torch.testing.assert_close(split(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("speedup, splits", [(1.7, True), (1.05, False)])
def test_decoding_splits_only_where_this_machines_probe_found_it_faster(monkeypatch, tmp_path,
                                                                       speedup, splits):
    """The probe runs once per machine (cached with its figures); fp32 decoding follows it."""
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "cpu_info", lambda: {"model": "Fake CPU", "flags": frozenset()})
    # a machine without the compiled kernel (whose layout tests/test_fp32_rows.py checks)
    monkeypatch.setattr(split_linear, "paying_kernel", lambda: None)
    probes = []
    monkeypatch.setattr(split_linear, "_probe",
                        lambda threads: probes.append(threads) or {"split_over_linear": speedup})
    for _ in range(2):
        model = build(tiny())
        for_decoding("auto", model)
        assert any(isinstance(m, SplitLinear) for m in model.modules()) == splits
    assert len(probes) == 1 and "split-linear|Fake CPU" in (tmp_path / "machine.json").read_text()


def test_the_probe_measures_both_layouts():
    figures = split_linear._probe(threads=2, reps=1)
    assert figures["linear_ms"] > 0 and figures["split_ms"] > 0
    assert figures["split_over_linear"] == pytest.approx(figures["linear_ms"] / figures["split_ms"])


@pytest.mark.parametrize("out_features, parts", [(1000, 2), (1001, 3), (7, 1)])
def test_a_shared_split_reads_the_table_it_was_given_without_a_copy(out_features, parts):
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(out_features, 24))
    head = SharedSplitLinear(table, parts)
    assert head.table.data_ptr() == table.data_ptr() and not list(head.parameters())
    for shape in ((1, 24), (3, 5, 24)):
        x = torch.randn(shape)
        torch.testing.assert_close(head(x), torch.nn.functional.linear(x, table), rtol=1e-6,
                                   atol=1e-6)


def test_decoding_splits_a_tied_head_over_the_embedding_table(monkeypatch):
    monkeypatch.setattr(split_linear, "split_speedup", lambda: 1.7)
    tied = build(tiny(spec="1+1R2+1", tie_embeddings=True, vocab_size=1024))
    for_decoding("auto", tied)
    assert isinstance(tied.embed_out, SharedSplitLinear)
    assert tied.embed_out.table.data_ptr() == tied.embed_in.weight.data_ptr()  # no second table
    untied = build(tiny(spec="1+1R2+1", vocab_size=1024))
    for_decoding("auto", untied)
    assert isinstance(untied.embed_out, SplitLinear)
    assert not split_tied_head(untied)
