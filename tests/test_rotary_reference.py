"""apply_rotary_ref (the float64 rotary embedding the GPU tests compare against): CPU only."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fa2cupy.reference import apply_rotary_ref


def _tables(rng, seqlen_ro, half):
    angle = rng.uniform(0, 2 * np.pi, (seqlen_ro, half))
    return np.cos(angle), np.sin(angle), angle


@st.composite
def cases(draw):
    headdim = draw(st.sampled_from([8, 16, 40, 64, 128]))
    rotary_dim = 2 * draw(st.integers(1, headdim // 2))
    return dict(batch=draw(st.integers(1, 3)), seqlen=draw(st.integers(1, 6)), nheads=draw(st.integers(1, 3)),
                headdim=headdim, rotary_dim=rotary_dim, seqlen_ro=draw(st.integers(1, 40)),
                interleaved=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))


def _draw(c):
    rng = np.random.default_rng(c["seed"])
    x = rng.standard_normal((c["batch"], c["seqlen"], c["nheads"], c["headdim"]))
    cos, sin, angle = _tables(rng, c["seqlen_ro"], c["rotary_dim"] // 2)
    positions = rng.integers(0, c["seqlen_ro"], (c["batch"], c["seqlen"]))
    return x, cos, sin, angle, positions


def _pairs(x, rotary_dim, interleaved):
    """(first, second) members of each rotated pair, (..., rotary_dim / 2) each."""
    half = rotary_dim // 2
    if interleaved:
        return x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    return x[..., :half], x[..., half:rotary_dim]


@given(cases())
def test_rotation_preserves_pair_norms_and_passes_the_rest(c):
    x, cos, sin, _, positions = _draw(c)
    y = apply_rotary_ref(x, cos, sin, positions, c["interleaved"])
    rd = c["rotary_dim"]
    a, b = _pairs(x, rd, c["interleaved"])
    ya, yb = _pairs(y, rd, c["interleaved"])
    np.testing.assert_allclose(ya**2 + yb**2, a**2 + b**2, rtol=1e-12, atol=1e-12)
    assert np.array_equal(y[..., rd:], x[..., rd:])
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)


@given(cases())
def test_matches_complex_multiplication(c):
    # RoPE is (a + ib) * exp(i angle) for each pair: an independent formulation of the same rotation.
    x, cos, sin, angle, positions = _draw(c)
    y = apply_rotary_ref(x, cos, sin, positions, c["interleaved"])
    a, b = _pairs(x, c["rotary_dim"], c["interleaved"])
    z = (a + 1j * b) * np.exp(1j * angle[positions])[:, :, None, :]
    ya, yb = _pairs(y, c["rotary_dim"], c["interleaved"])
    np.testing.assert_allclose(ya, z.real, atol=1e-12)
    np.testing.assert_allclose(yb, z.imag, atol=1e-12)


@given(cases())
def test_interleaved_and_neox_agree_under_the_column_permutation(c):
    # Interleaving the NeoX halves, (0, h, 1, h+1, ...), turns one convention into the other.
    x, cos, sin, _, positions = _draw(c)
    rd, half = c["rotary_dim"], c["rotary_dim"] // 2
    perm = np.arange(c["headdim"])
    perm[:rd] = np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)  # interleaved <- neox
    neox = apply_rotary_ref(x, cos, sin, positions, interleaved=False)
    inter = apply_rotary_ref(x[..., perm], cos, sin, positions, interleaved=True)
    np.testing.assert_allclose(inter, neox[..., perm], atol=1e-12)


def test_position_zero_of_an_identity_table_changes_nothing():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 2, 16))
    cos, sin, _ = _tables(rng, 10, 6)
    cos[0], sin[0] = 1.0, 0.0  # angle 0 at position 0, as in every RoPE table
    for interleaved in (True, False):
        assert np.array_equal(apply_rotary_ref(x, cos, sin, np.zeros((2, 3), int), interleaved), x)


def test_known_rotation():
    # A quarter turn maps (1, 0) to (0, 1) and (0, 1) to (-1, 0).
    x = np.array([1.0, 0.0, 0.0, 1.0, 5.0, 7.0]).reshape(1, 1, 1, 6)
    cos, sin = np.array([[0.0, 0.0]]), np.array([[1.0, 1.0]])
    y = apply_rotary_ref(x, cos, sin, np.zeros((1, 1), int), interleaved=True)
    np.testing.assert_allclose(y.reshape(-1), [0.0, 1.0, -1.0, 0.0, 5.0, 7.0], atol=1e-15)
    # NeoX pairs (0, 2) and (1, 3): (1, 0) -> (0, 1) and (0, 1) -> (-1, 0).
    y = apply_rotary_ref(x, cos, sin, np.zeros((1, 1), int), interleaved=False)
    np.testing.assert_allclose(y.reshape(-1), [0.0, -1.0, 1.0, 0.0, 5.0, 7.0], atol=1e-15)


def test_rotation_is_relative():
    # The point of RoPE: <R(p) q, R(p') k> depends on p - p' only.
    rng = np.random.default_rng(1)
    half, n = 8, 64
    theta = 10000.0 ** (-np.arange(half) / half)
    angle = np.arange(n)[:, None] * theta[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    q, k = rng.standard_normal((1, 1, 1, 2 * half)), rng.standard_normal((1, 1, 1, 2 * half))
    dots = [float(np.sum(apply_rotary_ref(q, cos, sin, [[p + 5]]) * apply_rotary_ref(k, cos, sin, [[p]])))
            for p in (0, 7, 30)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-10)


def test_bad_shapes():
    x = np.zeros((1, 2, 1, 8))
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_ref(x, np.ones((4, 5)), np.ones((4, 5)), np.zeros((1, 2), int))
    with pytest.raises(ValueError, match="positions"):
        apply_rotary_ref(x, np.ones((4, 2)), np.ones((4, 2)), np.zeros((2, 1), int))
