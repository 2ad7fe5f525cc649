"""The φ fit (meshlm.analysis.phi) recovers a known exponent, and reads the loop parameters off an
eval.json."""
import numpy as np
import pytest

from meshlm.analysis.phi import fit, loop_params
from meshlm.config import ModelConfig
from meshlm.model.accounting import describe


def synthetic(phi: float, noise: float = 0.0, seed: int = 0):
    rng, points = np.random.default_rng(seed), []
    for width in (1e6, 2e6, 4e6, 8e6):
        for r in (1, 2, 4, 8):
            once, rec = 0.4 * width, 0.6 * width
            points.append((once, rec, r,
                           1.7 + 40 * (once + r ** phi * rec) ** -0.3 + rng.normal(0, noise)))
    return points


@pytest.mark.parametrize("phi", [0.2, 0.46, 0.8])
def test_the_fit_recovers_a_known_exponent(phi):
    f = fit(synthetic(phi))
    assert f["phi"] == pytest.approx(phi, abs=0.01) and f["alpha"] == pytest.approx(0.3, abs=0.01)
    assert f["r2"] > 0.9999
    assert max(map(abs, f["residuals"])) < 1e-3 and len(f["residuals"]) == 16


def test_noise_moves_the_exponent_a_little_and_too_few_runs_are_refused():
    noisy = synthetic(0.46, noise=0.002)
    f = fit(noisy)
    assert f["phi"] == pytest.approx(0.46, abs=0.05)
    # the residuals are each run's loss minus the fit's: the noise, give or take the fit's error
    assert np.std(f["residuals"]) == pytest.approx(0.002, rel=0.5)
    with pytest.raises(ValueError, match="at least 5"):
        fit(synthetic(0.46)[:4])


def test_loop_parameters_split_the_core_from_the_rest():
    cfg = ModelConfig(spec="1+2R4+1", d_model=64, n_heads=4, vocab_size=64, scheme="base")
    acc = describe(cfg).to_dict()
    once, rec, r = loop_params(cfg.to_dict(), acc)
    layer = 12 * 64 ** 2 + 13 * 64  # a GPT-NeoX layer: 12d² + 13d
    assert ((rec, r) == (2 * layer, 4)
            and once == 2 * layer + 2 * 64 == acc["non_embedding_params"] - rec)
