"""Test-wide settings.

- One thread per process: these machines have 2 cores, and OpenMP spin-waiting with
  another busy process made 2-thread runs 40x slower (../shared/environment.md).
- Without a GPU, Triton kernels run in the interpreter (TRITON_INTERPRET=1). It must be
  set before triton.jit decorates any kernel, hence here, at collection time.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
