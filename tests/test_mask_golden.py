"""Golden vectors for ``mask_indices``: the mask is a wire format (sender and receiver each
derive it), so its output for fixed inputs is pinned here as literals. A change of the
specification applied to every backend and the reference alike (a wire-format break
between meshkern versions) passes the backend-vs-reference tests but fails this file.

Derivation: the literals were produced by ``_scalar_kept`` below, a plain-int Python
transcription of the spec in meshkern/reference_mask.py (no tensors, no meshkern code):
Philox4x32-10 with key (seed & 0xffffffff, seed >> 32) and counter
(d // 2, row, step, (boundary << 16) | microbatch); draw d takes words (w0, w1) for even
d and (w2, w3) for odd d as (hi, lo) of a 64-bit uniform x; t = floor(x * (j + 1) / 2**64)
with j = H - K + d; Floyd: keep j if t is already kept, else t; output ascending. The
scalar Philox is checked against the Random123 known-answer vectors first, and the
test re-derives every literal with it.
"""
import pytest

from meshkern import MaskKey, kept_dims, mask_indices
from meshkern.mask import WIRE_FORMAT_VERSION
from test_mask_common import cpu_backends

M32 = 0xFFFFFFFF
# Random123 kat_vectors, Philox4x32-10: (counter words, key words, output words)
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]

# (seed, boundary, step, microbatch, N rows, H, p) -> kept dims of rows 0..N-1 (wire format 1)
GOLDEN = [
    ((0, 0, 0, 0, 2, 16, 0.75),  # K = 4: two Philox blocks per row
     [[5, 10, 11, 14], [5, 6, 14, 15]]),
    ((2**40 + 7, 3, 123456, 5, 3, 40, 0.9),  # both seed words non-zero; K = 4
     [[17, 26, 32, 39], [4, 14, 17, 24], [5, 8, 11, 30]]),
    ((0xDEADBEEF12345678, 65535, 2**32 - 1, 65535, 2, 576, 0.95),  # every key field at its limit; K = 29 (odd)
     [[12, 24, 38, 41, 65, 96, 108, 130, 134, 139, 147, 156, 193, 207, 218, 221, 253, 295, 311, 323, 367, 408,
       421, 450, 451, 519, 532, 558, 568],
      [2, 40, 41, 60, 83, 101, 118, 126, 146, 161, 169, 197, 209, 224, 230, 256, 276, 301, 323, 334, 341, 349,
       395, 437, 438, 552, 558, 561, 563]]),
]


def _philox(c, k):
    c0, c1, c2, c3 = c
    k0, k1 = k
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c3 ^ k1) & M32, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


def _scalar_kept(seed, boundary, step, microbatch, row, H, K):
    chosen = set()
    for d in range(K):
        w = _philox((d // 2, row, step, (boundary << 16) | microbatch), (seed & M32, seed >> 32))
        hi, lo = (w[0], w[1]) if d % 2 == 0 else (w[2], w[3])
        j = H - K + d
        t = (((hi << 32) | lo) * (j + 1)) >> 64
        chosen.add(j if t in chosen else t)
    return sorted(chosen)


def test_the_vectors_are_for_this_wire_format():
    assert WIRE_FORMAT_VERSION == 1, "a new wire format needs new golden vectors (and this number with them)"


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_scalar_philox_matches_random123(counter, key, expected):
    assert _philox(counter, key) == expected


@pytest.mark.parametrize("case,rows", GOLDEN)
def test_golden_vectors_follow_from_the_written_spec(case, rows):
    seed, boundary, step, mb, N, H, p = case
    K = kept_dims(H, p)
    assert [_scalar_kept(seed, boundary, step, mb, r, H, K) for r in range(N)] == rows


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("case,rows", GOLDEN)
def test_mask_indices_match_the_golden_vectors(backend, case, rows):
    seed, boundary, step, mb, N, H, p = case
    got = mask_indices(MaskKey(seed, boundary, step, mb), N, H, p, backend=backend)
    assert got.tolist() == rows
