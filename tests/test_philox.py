"""Philox4x32-10 against the Random123 known-answer vectors, on every implementation
(pure-torch reference, C++ header via meshkern_C::philox4x32, Triton), and the
implementations against each other (and against Triton's own tl.philox) on random
counters."""
import pytest
import torch

from meshkern import reference_mask as ref
from test_mask_common import cpp_ready, triton_ready

# Random123 kat_vectors, philox4x32 with 10 rounds: (counter words, key words, output words)
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _reference(counters: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
    return torch.stack(ref.philox4x32_10(*counters.unbind(1), k0, k1), dim=1)


def _cpp(counters, k0, k1):
    return torch.ops.meshkern_C.philox4x32(counters, k0, k1)


def _triton(counters, k0, k1):
    from meshkern.triton_kernels.philox import philox4x32
    return philox4x32(counters, k0, k1)


IMPLS = [
    pytest.param(_reference, id="reference"),
    pytest.param(_cpp, id="cpp", marks=pytest.mark.skipif(not cpp_ready(), reason="meshkern._mask_C not built")),
    pytest.param(_triton, id="triton", marks=pytest.mark.skipif(not triton_ready(), reason="triton unavailable")),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("counter,key,expected", KAT)
def test_known_answers(impl, counter, key, expected):
    out = impl(torch.tensor([counter], dtype=torch.int64), *key)
    assert [int(x) for x in out[0]] == list(expected)


@pytest.mark.parametrize("impl", IMPLS[1:])
def test_matches_reference_on_random_counters(impl):
    g = torch.Generator().manual_seed(0)
    counters = torch.randint(0, 2**32, (257, 4), generator=g, dtype=torch.int64)
    for k0, k1 in [(0, 0), (0xDEADBEEF, 0x12345678), (2**32 - 1, 1)]:
        assert torch.equal(impl(counters, k0, k1), _reference(counters, k0, k1))


@pytest.mark.skipif(not triton_ready(), reason="triton unavailable")
def test_reference_matches_triton_builtin_philox():
    """Triton ships its own Philox (tl.philox): ours must agree with it word for word."""
    from meshkern.triton_kernels.philox import builtin_philox4x32
    g = torch.Generator().manual_seed(1)
    counters = torch.randint(0, 2**32, (64, 4), generator=g, dtype=torch.int64)
    seed = 0x0123456789ABCDEF
    assert torch.equal(builtin_philox4x32(counters, seed),
                       _reference(counters, seed & 0xFFFFFFFF, seed >> 32))


def test_draw_below_is_exact_multiply_shift():
    g = torch.Generator().manual_seed(2)
    hi = torch.randint(0, 2**32, (1000,), generator=g, dtype=torch.int64)
    lo = torch.randint(0, 2**32, (1000,), generator=g, dtype=torch.int64)
    n = torch.randint(1, 2**31 + 1, (1000,), generator=g, dtype=torch.int64)
    got = ref.draw_below(hi, lo, n)
    want = [((int(a) << 32 | int(b)) * int(c)) >> 64 for a, b, c in zip(hi, lo, n)]
    assert got.tolist() == want
    assert ref.draw_below(torch.tensor(2**32 - 1), torch.tensor(2**32 - 1), 2**31).item() == 2**31 - 1
