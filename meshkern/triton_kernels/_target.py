"""What a launcher may ask of the GPU it launches on: shared memory per block.

Launchers whose shared memory grows with a problem size (the Jacobi eigensolver holds a
[K, K] problem in one program) ask ``shared_memory_limit(device)`` before they launch and
refuse a configuration that would not fit, with a clear error, instead of letting the
driver fail the launch (Triton's OutOfResources).

``bench/compile_check.py`` compiles every kernel ahead of time for named archs on a
machine without a GPU; it runs the launchers on meta tensors under ``aot_arch(cc)`` so
that they take the decisions they would take on that arch. Importing this module does
not import triton.
"""
from __future__ import annotations

import contextlib

import torch

# Opt-in shared memory per block, bytes (cudaDevAttrMaxSharedMemoryPerBlockOptin; CUDA C
# Programming Guide, "Technical Specifications per Compute Capability"): 163 KiB on
# sm_80 / sm_87, 99 KiB on sm_86 / sm_89 (consumer Ampere / Ada), 227 KiB on sm_90.
SHARED_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_aot: list[int] = []  # the arch aot_arch() pretends to run on (innermost last)


@contextlib.contextmanager
def aot_arch(cc: int):
    """Within this block, launchers size their kernels for compute capability ``cc``
    (e.g. 86): what the ahead-of-time compile check needs on a machine without a GPU."""
    if cc not in SHARED_PER_BLOCK:
        raise ValueError(f"unknown compute capability {cc}; known: {sorted(SHARED_PER_BLOCK)}")
    _aot.append(cc)
    try:
        yield
    finally:
        _aot.pop()


def shared_memory_limit(device: torch.device) -> int | None:
    """Bytes of shared memory one program (block) may use on ``device``; None when there is
    no such limit (the CPU interpreter)."""
    if _aot:
        return SHARED_PER_BLOCK[_aot[-1]]
    if device.type != "cuda":
        return None
    from triton.runtime import driver  # noqa: PLC0415 (only with a GPU)

    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def gpu_shapes(device: torch.device) -> bool:
    """True when a launcher should pick its GPU launch shape: CUDA tensors, and the meta
    tensors of the ahead-of-time compile check. CPU tensors run in the interpreter, whose
    cost is per program instance, so launchers give them bigger blocks."""
    return device.type != "cpu"
