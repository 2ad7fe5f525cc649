"""Probe measures against hand cases and known invariances; the probe run on tiny models."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import build, tiny

from meshlm.analysis.probes import (
    cka,
    cka_matrix,
    effective_rank,
    entropy,
    normalised_spectrum,
    probe,
    relative_update,
)

KERNELS = ["rbf", "linear"]


def orthogonal(d: int, seed: int = 0) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed),
                                       dtype=torch.float64))
    return q


@pytest.mark.parametrize("kernel", KERNELS)
def test_cka_is_one_for_identical_inputs(kernel):
    x = torch.randn(40, 6)
    assert cka(x, x, kernel) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
def test_cka_is_invariant_to_orthogonal_transforms_and_isotropic_scaling(kernel):
    x, y = torch.randn(50, 8, dtype=torch.float64), torch.randn(50, 5, dtype=torch.float64)
    y = y + 0.5 * x[:, :5]  # related, so the value is far from both 0 and 1
    reference = cka(x, y, kernel)
    assert 0.1 < reference < 0.95
    assert cka(x @ orthogonal(8) * 3.7, y, kernel) == pytest.approx(reference, abs=1e-10)
    assert cka(x, 0.01 * y @ orthogonal(5, seed=1), kernel) == pytest.approx(reference, abs=1e-10)
    assert cka(x, x @ orthogonal(8, seed=2) * 0.2, kernel) == pytest.approx(1.0, abs=1e-10)


@pytest.mark.parametrize("kernel", KERNELS)
def test_cka_is_near_zero_for_independent_random_matrices(kernel):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1000, 4, generator=g), torch.randn(1000, 4, generator=g)
    assert cka(x, y, kernel) < 0.03


def test_linear_cka_of_two_vectors_is_their_squared_correlation():
    # centred x = (-1, 0, 1), y = (-1, 1, 0): <x, y> = 1, |x|² = |y|² = 2, correlation 1/2
    x, y = torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[1.0], [3.0], [2.0]])
    assert cka(x, y, "linear") == pytest.approx(0.25, abs=1e-12)


def direct_rbf_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Textbook formula with explicit loops: K_ij = exp(−|x_i − x_j|² / 2σ²), σ = median distance
    over i < j, HSIC = tr(K H L H) / (n − 1)², CKA = HSIC(K, L) / √(HSIC(K, K) HSIC(L, L))."""
    n = len(x)

    def gram(z):
        dist = [[float(np.linalg.norm(z[i] - z[j])) for j in range(n)] for i in range(n)]
        sigma = float(np.median([dist[i][j] for i in range(n) for j in range(i + 1, n)]))
        return np.array([[math.exp(-dist[i][j] ** 2 / (2 * sigma**2)) for j in range(n)]
                         for i in range(n)])

    h = np.eye(n) - np.ones((n, n)) / n
    k, l_ = gram(x), gram(y)
    hsic = lambda a, b: np.trace(a @ h @ b @ h) / (n - 1) ** 2  # noqa: E731
    return hsic(k, l_) / math.sqrt(hsic(k, k) * hsic(l_, l_))


def test_rbf_cka_matches_the_direct_formula_on_a_small_case():
    x = np.array([[0.0, 1.0], [1.0, 0.5], [3.0, -1.0], [0.5, 2.0], [2.0, 2.0]])
    y = np.array([[1.0], [0.0], [2.5], [0.7], [-1.0]])
    assert cka(torch.tensor(x), torch.tensor(y), "rbf") == pytest.approx(direct_rbf_cka(x, y),
                                                                         abs=1e-12)


def test_cka_matrix_is_symmetric_with_unit_diagonal():
    stages = [torch.randn(30, 4) for _ in range(3)]
    m = np.array(cka_matrix(stages, "rbf"))
    assert np.allclose(m, m.T) and np.allclose(np.diag(m), 1.0)
    assert m[0, 1] == pytest.approx(cka(stages[0], stages[1], "rbf"))


def matrix_with_singular_values(values, t: int = 20, d: int = 12) -> torch.Tensor:
    u = orthogonal(t)[:, :len(values)]
    v = orthogonal(d, seed=3)[:len(values)]
    return u @ torch.diag(torch.tensor(values, dtype=torch.float64)) @ v


@pytest.mark.parametrize("r", [1, 3, 7])
def test_effective_rank_of_r_equal_singular_values_is_r(r):
    x = matrix_with_singular_values([2.5] * r)
    assert effective_rank(x) == pytest.approx(r, rel=1e-9)
    spectrum = normalised_spectrum(x)
    assert len(spectrum) == 12  # min(T, d) values when fewer than 50 exist
    assert np.allclose(spectrum[:r], 1.0) and np.allclose(spectrum[r:], 0.0, atol=1e-12)


def test_spectrum_and_effective_rank_of_known_singular_values():
    x = matrix_with_singular_values([4.0, 2.0, 1.0])
    assert np.allclose(normalised_spectrum(x)[:4], [1.0, 0.5, 0.25, 0.0], atol=1e-12)
    p = np.array([4, 2, 1]) / 7
    assert effective_rank(x) == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-12)
    assert len(normalised_spectrum(torch.randn(80, 64))) == 50  # top-50 only


def test_relative_update_hand_cases():
    h = torch.randn(6, 4)
    assert relative_update(h, h) == 0.0
    assert relative_update(h, -h) == pytest.approx(2.0)
    assert relative_update(h, 2 * h) == pytest.approx(2 / 3)  # 2·|h| / (2|h| + |h|)
    assert relative_update(h, torch.zeros_like(h)) == pytest.approx(2.0)
    a, b = torch.tensor([[3.0, 0.0]]), torch.tensor([[0.0, 4.0]])
    assert relative_update(a, b) == pytest.approx(2 * 5 / 7)


def test_entropy_of_uniform_and_one_hot_weights():
    assert entropy(torch.full((2, 5), 0.2)).tolist() == pytest.approx([math.log(5)] * 2)
    assert entropy(torch.eye(3)).tolist() == pytest.approx([0.0] * 3)


@pytest.mark.parametrize("scheme", ["mesh", "base"])
def test_probe_reports_every_measure_as_mean_std_and_per_sample(scheme):
    model = build(tiny(scheme=scheme))
    samples = torch.randint(0, 97, (3, 16))
    states = []
    r = probe(model, samples, batch_size=2, states_out=states)
    k = model.config.layout.n_steps
    assert r["stages"] == ["e", *(f"h{t}" for t in range(k + 1)), "coda"]
    assert r["blocks"] == ["prelude", *(f"loop {t + 1}" for t in range(k)), "coda"]
    s = len(r["stages"])
    assert (np.array(r["cka_rbf"]["mean"]).shape == (s, s)
            and np.array(r["cka_linear"]["std"]).shape == (s, s))
    assert np.array(r["spectrum"]["mean"]).shape == (s, 16)  # min(T, d) = 16 values
    assert len(r["per_sample"]["update_core"]) == 3 and len(r["effective_rank"]["mean"]) == s
    assert len(states) == 3 and states[0].shape == (s, 16, model.config.d_model)
    if scheme == "base":  # h^{t+1} = f_core(h^t): the two views coincide
        assert r["update_core"] == r["update_state"] and "write_usage" not in r
    else:
        assert r["slots"] == k + 3 and r["max_entropy"] == pytest.approx(math.log(k + 3))
        # (pairs, slots); each read is a convex combination
        usage = np.array(r["read_usage"]["mean"])
        assert usage.shape == (k + 1, k + 3) and np.allclose(usage.sum(-1), 1.0)
        assert all(0 < v <= math.log(k + 3) + 1e-9 for v in r["write_entropy"]["mean"])
