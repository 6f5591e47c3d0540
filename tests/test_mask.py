"""The mask spec and the public ops: statistics, autograd, opcheck, wire size, errors.

Cross-backend bit-identity is in test_mask_backends.py; Philox known answers in
test_philox.py. Statistical tests use fixed keys, so they are deterministic; their
thresholds are 99.9% quantiles, i.e. a correct mask passes them for all but ~1 in 1000
keys, and a biased one (e.g. a per-dim keep rate off by 2%) fails them.
"""
import math

import pytest
import torch
from torch.library import opcheck

import meshkern
from meshkern import MaskKey, kept_dims, mask_indices, pack, unpack
from test_mask_common import cpu_backends, fastest_cpu_backend

KEY = MaskKey(seed=0x0123456789ABCDEF, boundary=3, step=1234, microbatch=7)


def _chi2_quantile_999(dof: int) -> float:
    """Wilson-Hilferty approximation of the chi-square 99.9% quantile."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


# ---------------------------------------------------------------- the mask itself

@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("H,p", [(64, 0.75), (320, 0.95), (7, 0.0), (5, 0.8)])
def test_exactly_k_distinct_ascending(backend, H, p):
    K = kept_dims(H, p)
    idx = mask_indices(KEY, 50, H, p, backend=backend)
    assert idx.shape == (50, K) and not idx.dtype.is_floating_point
    assert (idx >= 0).all() and (idx < H).all()
    assert (idx[:, 1:] > idx[:, :-1]).all()  # strictly ascending => distinct
    if p == 0.0:
        assert torch.equal(idx, torch.arange(H).expand(50, H))


@pytest.mark.parametrize("H,p", [(64, 0.75), (320, 0.95)])
def test_chi_square_per_dim_keep_frequency(H, p):
    """Each dim is kept with probability K/H: per-dim counts over many rows."""
    T, K = 20000, kept_dims(H, p)
    idx = mask_indices(KEY, T, H, p, backend=fastest_cpu_backend())
    counts = torch.bincount(idx.flatten(), minlength=H).double()
    q = K / H
    # Each row's indicator vector has covariance q(1-q) H/(H-1) (I - 11^T/H) (exactly K
    # of H without replacement), so this statistic is chi-square with H-1 dof.
    stat = ((counts - T * q) ** 2).sum() / (T * q * (1 - q) * H / (H - 1))
    assert stat < _chi2_quantile_999(H - 1), (stat, _chi2_quantile_999(H - 1))


def _mean_overlap_check(a: torch.Tensor, b: torch.Tensor, H: int, K: int):
    inter = torch.zeros(a.shape[0], H, dtype=torch.int32)
    inter.scatter_add_(1, a, torch.ones_like(a, dtype=torch.int32))
    inter.scatter_add_(1, b, torch.ones_like(b, dtype=torch.int32))
    overlap = (inter == 2).sum(1).double()
    mean = K * K / H  # hypergeometric mean of |A n B| for independent uniform K-subsets
    var = K * (K / H) * ((H - K) / H) * ((H - K) / (H - 1))
    se = math.sqrt(var / a.shape[0])
    assert abs(overlap.mean().item() - mean) < 4 * se, (overlap.mean().item(), mean, se)


def test_overlap_between_tokens_is_k2_over_h():
    H, p = 320, 0.9
    K = kept_dims(H, p)
    idx = mask_indices(KEY, 8000, H, p, backend=fastest_cpu_backend())
    _mean_overlap_check(idx[0::2], idx[1::2], H, K)


@pytest.mark.parametrize("field", ["seed", "boundary", "step", "microbatch"])
def test_keys_differing_in_one_field_are_independent(field):
    H, p, T = 320, 0.9, 4000
    K = kept_dims(H, p)
    other = MaskKey(**{**KEY.__dict__, field: getattr(KEY, field) + 1})
    a = mask_indices(KEY, T, H, p, backend=fastest_cpu_backend())
    b = mask_indices(other, T, H, p, backend=fastest_cpu_backend())
    _mean_overlap_check(a, b, H, K)


def test_leading_dims_map_to_flattened_rows():
    h = torch.randn(2, 3, 40)
    p = 0.75
    idx = mask_indices(KEY, 6, 40, p).reshape(2, 3, -1)
    assert torch.equal(pack(h, KEY, p), h.gather(-1, idx))


# ---------------------------------------------------------------- ops

@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_pack_exact_and_zeros_elsewhere(backend, dtype):
    H, p = 96, 0.9
    h = torch.randn(3, 5, H).to(dtype)
    v = pack(h, KEY, p, backend=backend)
    u = unpack(v, KEY, H, p, backend=backend)
    kept = torch.zeros(3, 5, H, dtype=torch.bool).scatter_(-1, mask_indices(KEY, 15, H, p).reshape(3, 5, -1), True)
    assert torch.equal(u, torch.where(kept, h, torch.zeros_like(h)))
    assert torch.equal(pack(u, KEY, p, backend=backend), v)


def test_wire_size_is_rows_times_k_times_element_size():
    h = torch.randn(4, 128, 2048)
    p = 0.95
    K = kept_dims(2048, p)
    v = pack(h, KEY, p)
    assert v.shape == (4, 128, K)
    assert v.numel() * v.element_size() == 4 * 128 * K * 4
    assert v.untyped_storage().nbytes() == 4 * 128 * K * 4
    # Nothing else is needed: a receiver with only the bytes, key, H and p recovers h * mask.
    wire = bytes(v.numpy().tobytes())
    received = torch.frombuffer(bytearray(wire), dtype=torch.float32).reshape(4, 128, K)
    assert torch.equal(unpack(received, KEY, 2048, p), unpack(v, KEY, 2048, p))


@pytest.mark.parametrize("backend", cpu_backends())
def test_rescale_is_h_over_k_and_unbiased(backend):
    H, p = 50, 0.9  # K = 5, H/K = 10 = 1/(1-p)
    h = torch.randn(2000, H, dtype=torch.float64)
    v = pack(h, KEY, p, rescale=True, backend=backend)
    assert torch.equal(v, pack(h, KEY, p, backend=backend) * (H / 5))
    est = unpack(pack(h, KEY, p, backend=backend), KEY, H, p, rescale=True, backend=backend)
    # E[est] = h: averaged over rows with h constant the estimate converges.
    c = torch.ones(20000, H, dtype=torch.float64)
    mean = unpack(pack(c, KEY, p, backend=backend), KEY, H, p, rescale=True, backend=backend).mean(0)
    assert (mean - 1).abs().max() < 4 * math.sqrt(9 / 20000)  # per-dim std of 10*Bernoulli(0.1)
    assert est.shape == h.shape


@pytest.mark.parametrize("backend", cpu_backends()[:2])  # triton: see the next test
@pytest.mark.parametrize("rescale", [False, True])
def test_gradcheck_double(backend, rescale):
    h = torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, kept_dims(10, 0.6), dtype=torch.float64, requires_grad=True)
    f = lambda x: pack(x, KEY, 0.6, rescale=rescale, backend=backend)  # noqa: E731
    g = lambda x: unpack(x, KEY, 10, 0.6, rescale=rescale, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(f, (h,))
    assert torch.autograd.gradcheck(g, (v,))
    assert torch.autograd.gradgradcheck(f, (h,))


@pytest.mark.parametrize("backend", cpu_backends()[2:])
def test_backward_matches_reference(backend):
    """Autograd wiring is backend-independent (gradcheck above); here one backward per
    op on the interpreted Triton backend (gradcheck would take minutes) vs the reference."""
    h = torch.randn(3, 40, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    gp, gu = torch.randn(3, 10, dtype=torch.float64), torch.randn(3, 40, dtype=torch.float64)
    grads = {}
    for b in ("reference", backend):
        pack(h, KEY, 0.75, rescale=True, backend=b).backward(gp)
        unpack(v, KEY, 40, 0.75, rescale=True, backend=b).backward(gu)
        grads[b] = (h.grad.clone(), v.grad.clone())
        h.grad = v.grad = None
    assert all(torch.equal(a, b) for a, b in zip(grads["reference"], grads[backend]))


def test_grad_of_pack_is_unpack_of_grad():
    h = torch.randn(4, 64, requires_grad=True)
    gout = torch.randn(4, kept_dims(64, 0.5))
    pack(h, KEY, 0.5, rescale=True).backward(gout)
    assert torch.equal(h.grad, unpack(gout, KEY, 64, 0.5, rescale=True))


@pytest.mark.parametrize("backend", cpu_backends())
def test_opcheck(backend):
    w = KEY.words()
    h = torch.randn(2, 3, 40, requires_grad=True)
    v = torch.randn(2, 3, 10, requires_grad=True)
    opcheck(torch.ops.meshkern.mask_pack.default, (h, *w, 0.75, True, backend))
    opcheck(torch.ops.meshkern.mask_unpack.default, (v, *w, 40, 0.75, False, backend))
    opcheck(torch.ops.meshkern.mask_indices.default, (*w, 6, 40, 0.75, torch.device("cpu"), backend))


@pytest.mark.parametrize("backend", cpu_backends())
def test_non_contiguous_inputs(backend):
    base = torch.randn(40, 6, 5)
    h = base.permute(1, 2, 0)  # [6, 5, 40], non-contiguous
    assert not h.is_contiguous()
    assert torch.equal(pack(h, KEY, 0.75, backend=backend), pack(h.contiguous(), KEY, 0.75, backend="reference"))
    v = torch.randn(10, 6).t()  # [6, 10]
    assert torch.equal(unpack(v, KEY, 40, 0.75, backend=backend), unpack(v.contiguous(), KEY, 40, 0.75))


# ---------------------------------------------------------------- errors

def test_kept_dims():
    assert kept_dims(2048, 0.95) == 102 and kept_dims(4096, 0.9) == 410 and kept_dims(7, 0.0) == 7
    with pytest.raises(ValueError, match="p must be"):
        kept_dims(64, 1.0)
    with pytest.raises(ValueError, match="p must be"):
        kept_dims(64, -0.1)
    with pytest.raises(ValueError, match="K=round"):
        kept_dims(64, 0.999)


@pytest.mark.parametrize("kwargs,field", [
    (dict(seed=-1, boundary=0, step=0, microbatch=0), "seed"),
    (dict(seed=2**64, boundary=0, step=0, microbatch=0), "seed"),
    (dict(seed=0, boundary=2**16, step=0, microbatch=0), "boundary"),
    (dict(seed=0, boundary=0, step=2**32, microbatch=0), "step"),
    (dict(seed=0, boundary=0, step=0, microbatch=-3), "microbatch"),
    (dict(seed=1.5, boundary=0, step=0, microbatch=0), "seed"),
    (dict(seed=0, boundary=True, step=0, microbatch=0), "boundary"),
])
def test_malformed_key(kwargs, field):
    with pytest.raises(ValueError, match=f"malformed key: {field}"):
        MaskKey(**kwargs)


def test_bad_inputs_are_named():
    h = torch.randn(4, 64)
    with pytest.raises(ValueError, match="p must be"):
        pack(h, KEY, 1.0)
    with pytest.raises(ValueError, match="K=round"):
        pack(h, KEY, 0.999)
    with pytest.raises(TypeError, match="float16/bfloat16/float32/float64"):
        pack(torch.ones(4, 64, dtype=torch.int32), KEY, 0.5)
    with pytest.raises(TypeError, match="MaskKey"):
        pack(h, (1, 2, 3, 4), 0.5)
    v = pack(h, KEY, 0.5)
    with pytest.raises(ValueError, match="does not match"):
        unpack(v, KEY, 80, 0.5)  # (an H with the same K cannot be told apart)
    with pytest.raises(ValueError, match="does not match"):
        unpack(v, KEY, 64, 0.75)
    with pytest.raises(TypeError, match="float16/bfloat16/float32/float64"):
        unpack(v.long(), KEY, 64, 0.5)
    with pytest.raises(ValueError, match="malformed key"):  # the raw op validates too
        torch.ops.meshkern.mask_pack(h, 2**32, 0, 0, 0, 0, 0.5, False, "auto")


def test_public_api_is_reexported():
    assert meshkern.pack is pack and meshkern.unpack is unpack and meshkern.MaskKey is MaskKey


def test_package_lists_its_public_modules_and_imports_them_lazily():
    import subprocess
    import sys

    for name in meshkern.__all__:
        assert getattr(meshkern, name) is not None
    assert meshkern.spectral.project is sys.modules["meshkern.spectral"].project
    assert meshkern.optim.SpectralAdamW.__module__ == "meshkern.optim"
    assert {"spectral", "optim", "compress", "diloco", "mask"} <= set(dir(meshkern))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        meshkern.nope
    # `import meshkern` stays cheap: the heavier modules load on first attribute access
    code = ("import sys, meshkern; lazy = ['meshkern.' + m for m in ('spectral', 'optim', 'compress', 'diloco')]; "
            "assert not [m for m in lazy if m in sys.modules], sys.modules.keys(); "
            "assert meshkern.compress.PowerSGD and meshkern.diloco.StreamingDiLoCo; "
            "assert all(m in sys.modules for m in ('meshkern.compress', 'meshkern.diloco'))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("backend", cpu_backends())
def test_empty_inputs(backend):
    assert pack(torch.empty(0, 40), KEY, 0.75, backend=backend).shape == (0, 10)
    assert unpack(torch.empty(2, 0, 10), KEY, 40, 0.75, backend=backend).shape == (2, 0, 40)
    assert mask_indices(KEY, 0, 40, 0.75, backend=backend).shape == (0, 10)


def test_numpy_scalars_are_plain_numbers():
    np = pytest.importorskip("numpy")
    h = torch.randn(3, 40)
    v = pack(h, KEY, 0.5)
    assert torch.equal(pack(h, KEY, np.float32(0.5)), v)
    assert torch.equal(unpack(v, KEY, np.int64(40), np.float64(0.5)), unpack(v, KEY, 40, 0.5))
    assert torch.equal(mask_indices(KEY, np.int64(3), np.int32(40), np.float32(0.5)), mask_indices(KEY, 3, 40, 0.5))
    assert kept_dims(np.int64(2048), np.float32(0.75)) == 512
    # bools and tensors are not numbers here
    for H, p in ((True, 0.5), (40, False), (torch.tensor(40), 0.5), (40, torch.tensor(0.5))):
        with pytest.raises(ValueError, match="H must be|p must be"):
            kept_dims(H, p)
    with pytest.raises(ValueError, match="T must be"):
        mask_indices(KEY, True, 40, 0.5)


def test_backend_none_means_auto_and_bad_types_are_named():
    h = torch.randn(3, 40)
    assert torch.equal(pack(h, KEY, 0.5, backend=None), pack(h, KEY, 0.5))
    v = pack(h, KEY, 0.5)
    assert torch.equal(unpack(v, KEY, 40, 0.5, backend=None), unpack(v, KEY, 40, 0.5))
    assert torch.equal(mask_indices(KEY, 3, 40, 0.5, backend=None), mask_indices(KEY, 3, 40, 0.5))
    with pytest.raises(TypeError, match="backend must be a str"):
        pack(h, KEY, 0.5, backend=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch build without CUDA")
def test_unusable_device_is_named():
    with pytest.raises(ValueError, match="device='cuda'"):
        mask_indices(KEY, 2, 40, 0.5, device="cuda")
