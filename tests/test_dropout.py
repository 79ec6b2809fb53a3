"""Dropout's keep mask: the Philox4x32-7 draw that cuda/attention/masks.cuh (Dropout) documents, written out in NumPy.

CPU: the NumPy Philox4x32 reproduces Random123's known-answer vectors (7 and 10 rounds), and fa2cupy.forward's keep
threshold realises p in steps of 1/256 with a scale that is the exact inverse of the keep probability.
GPU: fa2cupy.dropout_mask (the kernels' Dropout::keep_one, one Philox call per score) equals the NumPy definition,
bit for bit; the attention kernels, which share each call between 16 scores, are checked against dropout_mask in
tests/test_varlen_mods_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from fa2cupy import forward

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_LOW = np.uint64(0xFFFFFFFF)


def philox4x32(counter, key, rounds: int) -> tuple:
    """Philox4x32-``rounds`` (Salmon et al. 2011, Random123's round and key schedule) of ``counter`` (four arrays
    of 32-bit values, broadcast together) under ``key`` (two ints): the four 32-bit output words, uint64 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _LOW for c in counter)
    k0, k1 = np.uint64(key[0] & 0xFFFFFFFF), np.uint64(key[1] & 0xFFFFFFFF)
    for _ in range(rounds):
        p0, p1 = np.uint64(_M0) * c0, np.uint64(_M1) * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _LOW, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _LOW
        k0, k1 = (k0 + np.uint64(_W0)) & _LOW, (k1 + np.uint64(_W1)) & _LOW
    return c0, c1, c2, c3


def keep_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, seed: int,
              offset: int) -> np.ndarray:
    """The keep mask as cuda/attention/masks.cuh defines it: score (i, j) of bh = batch * nheads + head has the number byte
    (j >> 3) & 3 of word (i >> 3) & 3 of Philox4x32-7 with key (seed lo, seed hi ^ offset hi) and counter
    (bh, (i >> 5) << 3 | (i & 7), offset lo, (j >> 5) << 3 | (j & 7)), and is kept iff that number is below
    forward.dropout_threshold(p) (every score when the threshold is 0). bool (batch, nheads, seqlen_q, seqlen_k)."""
    threshold = forward.dropout_threshold(dropout_p)
    shape = (batch, nheads, seqlen_q, seqlen_k)
    if threshold == 0:
        return np.ones(shape, dtype=bool)
    bh = np.arange(batch * nheads, dtype=np.uint64)[:, None, None]
    i = np.arange(seqlen_q, dtype=np.uint64)[None, :, None]
    j = np.arange(seqlen_k, dtype=np.uint64)[None, None, :]
    three, five, seven = np.uint64(3), np.uint64(5), np.uint64(7)
    group = lambda x: (x >> five) << three | (x & seven)  # noqa: E731 -- the 32-block and residue mod 8
    words = philox4x32((bh, group(i), offset & 0xFFFFFFFF, group(j)), (seed & 0xFFFFFFFF, (seed >> 32) ^ (offset >> 32)),
                       7)
    word = np.choose(((i >> three) & three).astype(np.intp), np.broadcast_arrays(*words))
    number = (word >> (np.uint64(8) * ((j >> three) & three))) & np.uint64(0xFF)
    return (number < threshold).reshape(shape)


# Random123's kat_vectors: philox4x32 rounds, counter, key -> output.
KNOWN_ANSWERS = [
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("rounds, counter, key, expected", KNOWN_ANSWERS)
def test_philox_matches_random123_known_answers(rounds, counter, key, expected):
    assert tuple(int(w) for w in philox4x32(counter, key, rounds)) == expected


def test_keep_mask_takes_one_call_per_residue_grid():
    """The 16 scores of queries {x + 8a} x keys {y + 8b} of a 32 x 32 block are the 16 bytes of one call."""
    words = philox4x32((5, 2 << 3 | 6, 9, 1 << 3 | 3), (11, 12 ^ 0), 7)
    numbers = [(int(words[a]) >> 8 * b) & 0xFF for a in range(4) for b in range(4)]
    threshold = forward.dropout_threshold(0.5)
    mask = keep_mask(1, 6, 96, 64, 0.5, (12 << 32) | 11, 9)[0, 5]
    assert [bool(mask[64 + 6 + 8 * a, 32 + 3 + 8 * b]) for a in range(4) for b in range(4)] == [
        n < threshold for n in numbers]


@pytest.mark.parametrize("p", [0.001, 0.002, 0.01, 0.1, 0.25, 1 / 3, 0.5, 0.9, 0.997, 0.999])
def test_dropout_p_is_realised_in_steps_of_1_256_with_the_exact_inverse_scale(p):
    threshold, scale = forward.dropout_scalars(p)
    realised = forward.realised_dropout_p(p)
    if p < 1 / 512:
        assert (threshold, scale, realised) == (0, 1.0, 0.0)  # nothing to drop: dropout off
        return
    assert threshold == forward.dropout_threshold(p) and 1 <= threshold <= 255
    assert realised == 1 - threshold / 256
    assert abs(realised - p) <= 1 / 512 + 1e-12 or threshold == 1  # the nearest step (p > 1 - 1/512: keep 1/256)
    assert scale == np.float32(256 / threshold)  # 1 / keep probability, so E[kept * scale] is the undropped value


def test_no_dropout_keeps_everything():
    assert forward.dropout_scalars(0.0) == (0, 1.0) and forward.realised_dropout_p(0.0) == 0.0
    assert keep_mask(1, 1, 3, 5, 0.001, 1, 2).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shape, p, seed, offset", [
    ((2, 3, 70, 100), 0.1, 1234, 0),
    ((1, 2, 129, 33), 0.5, (1 << 64) - 1, (1 << 40) + 7),   # every seed bit, an offset with a high word
    ((3, 1, 1, 200), 0.9, 0xDEADBEEF12345678, 3),
    ((1, 1, 64, 64), 0.3, 5, 0xFFFFFFFF),
])
def test_dropout_mask_is_the_documented_draw(shape, p, seed, offset):
    import cupy

    import fa2cupy

    got = cupy.asnumpy(fa2cupy.dropout_mask(*shape, p, seed, offset))
    assert np.array_equal(got, keep_mask(*shape, p, seed, offset))
