"""Parameter counts and FLOPs reproduce the papers' figures exactly (Pythia's, and the MeSH paper's
1.4B rows), computed on the meta device. The 160M and 410M router counts are not in the paper: they
are derived from 2·(K+1)·B·(d+1)."""
import resource

import pytest
import torch

from meshlm.config import ModelConfig
from meshlm.model import MeshLM
from meshlm.model.accounting import account, describe


@pytest.mark.parametrize("preset, scheme, non_embedding, scheme_params", [
    ("pythia-1.4b-4+8R2+4", "base", 805_736_448, 0),
    ("pythia-1.4b-4+8R2+4", "mesh", 805_797_918, 61_470),
    ("pythia-1.4b", "vanilla", 1_208_602_624, 0),
    ("pythia-160m", "vanilla", 85_056_000, 0),
    ("pythia-160m-2+4R2+2", "mesh", None, 23_070),
    ("pythia-410m-4+8R2+4", "mesh", None, 30_750),
    ("pythia-410m-3+6R3+3", "mesh", None, 49_200),
    ("pythia-70m", "vanilla", 18_915_328, 0),
    ("pythia-410m", "vanilla", 302_311_424, 0),
    ("pythia-1b", "vanilla", 805_736_448, 0),
    ("pythia-2.8b", "vanilla", 2_517_652_480, 0),
    ("pythia-6.9b", "vanilla", 6_444_163_072, 0),
])
def test_paper_parameter_counts(preset, scheme, non_embedding, scheme_params):
    acc = describe(ModelConfig.from_preset(preset, scheme=scheme))
    if non_embedding is not None:
        assert acc.non_embedding_params == non_embedding
    assert acc.scheme_params == scheme_params
    assert acc.embedding_params == 2 * 50304 * ModelConfig.from_preset(preset).d_model


def test_non_embedding_formula_holds_for_every_layout():
    """layers·(12d² + 13d) + 2d over unique layers, plus 2·(K+1)·B·(d+1) router parameters for
    MeSH."""
    for spec in ["3+6R3+3", "4+8+8+4", "1+2R2+3R2+1"]:
        cfg = ModelConfig.from_preset("pythia-410m", spec=spec, scheme="mesh")
        d, lay = cfg.d_model, cfg.layout
        b = lay.n_steps + 3
        expected = lay.unique_depth * (12 * d * d + 13 * d) + 2 * d + 2 * (lay.n_steps
                                                                           + 1) * b * (d + 1)
        assert describe(cfg).non_embedding_params == expected


def test_mesh_flops_overhead_matches_the_paper():
    """≈ 0.7551 GFLOPs per forward over 4096 tokens at 1.4B `4+8R2+4` (the paper's figure)."""
    acc = describe(ModelConfig.from_preset("pythia-1.4b-4+8R2+4"))
    assert acc.scheme_flops_per_token * 4096 == 755_097_600
    assert acc.scheme_flops_per_token / acc.forward_flops_per_token < 2e-4


def test_flops_count_unrolled_layers():
    base = describe(ModelConfig.from_preset("pythia-410m-4+8R2+4", scheme="base"))
    vanilla = describe(ModelConfig.from_preset("pythia-410m"))
    assert base.unrolled_layers == vanilla.unrolled_layers == 24
    assert base.forward_flops_per_token == vanilla.forward_flops_per_token
    assert base.train_flops_per_token == 3 * base.forward_flops_per_token
    assert base.unique_layers == 16 and base.loop_steps == 2


def test_describe_allocates_nothing():
    cfg = ModelConfig.from_preset("pythia-6.9b-6+10R2+6")
    describe(cfg)  # warm imports
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    acc = describe(cfg)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    # meta tensors: the 6.9B parameters (27 GB in fp32) are never allocated
    assert grown_mib < 256, grown_mib
    assert acc.total_params > 4e9
    with torch.device("meta"):
        assert all(p.is_meta for p in MeshLM(cfg).parameters())


def test_account_counts_a_real_model_the_same_way():
    cfg = ModelConfig.from_preset("tiny")
    assert account(MeshLM(cfg)) == describe(cfg)
