"""Ahead-of-time compile check of meshkern's GPU kernels, on a machine without a GPU.

    python -m bench.compile_check --triton              # every Triton kernel, sm_80/86/89/90
    python -m bench.compile_check --triton --only mask,pca --arch 86
    python -m bench.compile_check --cuda                # every csrc/**/*.cu with nvcc (slow:
                                                        # minutes; a pre-release step)

--triton runs every Triton launcher (meshkern/triton_kernels/*.py) on meta tensors of the
shapes and dtypes the trainer uses (fp32 and bf16 where a kernel takes them; the hidden
sizes of SmolLM2-135M (576), Llama-3.2-1B (2048) and Llama-3-8B (4096)), under
``_target.aot_arch(cc)`` so that the launcher sizes the kernel for that arch, and
captures each launch instead of running it: kernel, arguments, constexprs, num_warps.
Each distinct launch is then compiled by Triton for that arch (``triton.compile`` of an
``ASTSource`` at a ``GPUTarget``; PTX + cubin, ptxas -v for registers and spills). One
line per kernel, configuration and arch:

    OK      mask.pack bf16 H=2048 [_move_kernel w4 hot] sm_86: 48 regs, 0 B spill, 4096 B smem
    FAIL    ... (what is wrong)       ERROR ... (the compiler's message)
    REFUSED ... (the launcher refuses this configuration on this arch, with its message)

Exit status 1 when any configuration fails to compile, asks for more shared memory than
the arch allows per block (``_target.SHARED_PER_BLOCK``), spills in a kernel its module
lists in ``HOT_KERNELS``, or needs more shared memory than its launcher's own estimate
(the estimate is what the launcher refuses on). REFUSED is not a failure: the op falls
back (auto backend) or raises that error (forced). Results are cached per (kernel
source, signature, constexprs, options, arch, triton version) in
$MESHKERN_COMPILE_CACHE (default ~/.cache/meshkern/compile_check), so a rerun with
unchanged kernels takes seconds; --no-cache recompiles. Compiles run in --jobs worker
processes (default: the CPU count).

Pinned to Triton 3.7.x's launcher internals (JITFunction.run / _pack_args and the
binder of triton.runtime.jit): another Triton fails with a message saying so.

--cuda: see bench/compile_check_cuda.py.
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import contextlib
import dataclasses
import hashlib
import io
import json
import multiprocessing
import os
import re
import sys
import time

ARCHS = (80, 86, 89, 90)
HIDDEN = (576, 2048, 4096)  # SmolLM2-135M, Llama-3.2-1B, Llama-3-8B
# Token rows per launch: 8 sequences of 2048 tokens (the paper's context) is one
# micro-batch's boundary tensor; only block-size choices depend on it, and they saturate
# long before this many rows.
ROWS = 16384


@dataclasses.dataclass
class Launch:
    """One captured kernel launch (what ``kernel[grid](*args, **kwargs)`` was given)."""
    fn: object
    args: tuple
    kwargs: dict


@dataclasses.dataclass
class Job:
    """One configuration on one arch: the launches it makes (or why the launcher refused)."""
    case: str
    arch: int
    launches: list
    refused: str | None = None


@contextlib.contextmanager
def capture():
    """Record every Triton launch made inside the block instead of running it."""
    from triton.runtime.jit import JITFunction

    seen: list[Launch] = []
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        seen.append(Launch(self, args, kwargs))

    JITFunction.run = run
    try:
        yield seen
    finally:
        JITFunction.run = original


# ----------------------------------------------------------------------------- cases
def _meta(*shape, dtype):
    import torch

    return torch.empty(*shape, dtype=dtype, device="meta")


def cases():
    """(name, thunk) for every configuration: the thunk calls a launcher on meta tensors."""
    import torch

    from meshkern import kept_dims
    from meshkern.spectral import DEFAULT_SWEEPS
    from meshkern.triton_kernels import jacobi, mask, philox, projection, subspace

    words = (0x12345678, 0x9ABCDEF0, 100, (3 << 16) | 7)  # (k0, k1, step, tag): runtime values only
    f32, bf16 = torch.float32, torch.bfloat16
    out = []
    for H in HIDDEN:
        K = kept_dims(H, 0.95)  # the paper's p
        out.append((f"mask.indices H={H}", lambda H=H, K=K: mask.indices(_meta(ROWS, K, dtype=torch.int64), words, H)))
        for dt in (f32, bf16):
            n = _name(dt)
            out.append((f"mask.pack {n} H={H}", lambda H=H, K=K, dt=dt: mask.pack(_meta(ROWS, H, dtype=dt), words, K, None)))
            out.append((f"mask.unpack {n} H={H} rescale",
                        lambda H=H, K=K, dt=dt: mask.unpack(_meta(ROWS, K, dtype=dt), words, H, H / K)))
    ctr = _meta(ROWS, 4, dtype=torch.int64)  # the known-answer tests' kernel (not a hot path)
    out.append(("philox ours", lambda: philox.philox4x32(ctr, 1, 2)))
    out.append(("philox tl.philox", lambda: philox.builtin_philox4x32(ctr, 1)))
    for dt in (f32, bf16):
        for H in HIDDEN:
            for r in (16, 32, 64, 128):  # the trainer's rank 16, the optimizer's default 32, 64, 128
                def proj(dt=dt, H=H, r=r):
                    G = _meta(1, H, H, dtype=dt)
                    U, V, S = _meta(1, H, r, dtype=f32), _meta(1, H, r, dtype=f32), _meta(1, r, dtype=f32)
                    projection.spectral_project(G, U, S, V, 1e-3, 0.3, torch.empty_like(G))
                out.append((f"projection {_name(dt)} {H}x{H} r={r}", proj))
    for dt in (f32, torch.float64):
        for k in (16, 32, 48, 112):  # K = 16, 32, 64, 128; 112: the krylov Gram at rank 32
            out.append((f"jacobi {_name(dt)} k={k}",
                        lambda dt=dt, k=k: jacobi.sym_eig_jacobi(_meta(64, k, k, dtype=dt), DEFAULT_SWEEPS)))
    for dt in (f32, bf16):
        for H in HIDDEN:
            k = H // 16  # the subspace codec's default width (1/16 of dense fp32)
            ids = _meta(ROWS, dtype=torch.int64)

            def enc(dt=dt, H=H, k=k, ids=ids):
                subspace.encode(_meta(ROWS, H, dtype=dt), ids, None, None, _meta(49152, k, dtype=dt),
                                _meta(H, k, dtype=dt))

            def dec(dt=dt, H=H, k=k, ids=ids):
                subspace.decode(_meta(ROWS, k, dtype=dt), ids, _meta(49152, H, dtype=dt), None, _meta(H, k, dtype=dt))
            out.append((f"subspace.encode table {_name(dt)} H={H} k={k}", enc))
            out.append((f"subspace.decode E {_name(dt)} H={H} k={k}", dec))
    out.extend(_pca_cases())
    out.extend(_pca_nf_cases())
    return out


def _pca_cases():
    """The pca codec's defaults (int4 body, int8 sink row, k = its default width) at each
    hidden size, fp32 and bf16 boundary tensors of 2048-token sequences."""
    import torch

    from meshkern.pca import CODEC_WIDTH
    from meshkern.triton_kernels import pca

    T = 2048
    B = max(1, ROWS // T)
    N = B * (T - 1)  # body rows: position 0 of each sequence is the sink row
    body, sinks = (T - 1, T, 1), (1, T, 0)  # row maps (meshkern/triton_kernels/pca.py)
    f = dict(dtype=torch.float32)
    out = []
    for dt in (torch.float32, torch.bfloat16):
        for H in HIDDEN:
            k = CODEC_WIDTH[H]

            def enc(dt=dt, H=H, k=k):
                x = _meta(B * T, H, dtype=dt)
                pca.encode(x, N, body, _meta(H, **f), _meta(H, k, **f), _meta(k, **f), 4)
                pca.quantize_rows(x, B, H, sinks, 8)

            def dec(dt=dt, H=H, k=k):
                pca.decode(_meta(N, (k + 1) // 2, dtype=torch.uint8), _meta(N, **f), _meta(k, **f), _meta(H, k, **f),
                           _meta(H, **f), _meta(B * T, H, dtype=dt), N, body, 4)
            out.append((f"pca.encode {_name(dt)} H={H} k={k}", enc))
            out.append((f"pca.decode {_name(dt)} H={H} k={k}", dec))
    return out


def _pca_nf_cases():
    """pca:quant=nf's pack / unpack (meshkern/triton_kernels/pca_nf.py) at each hidden size:
    the widths calibration allocates at 1/15 and 1/30 of dense fp32 on a SmolLM2-like
    spectrum (variances ~ i^-1.5, as bench.pca_nf_bench), and the layouts at the kernel's
    limits: one-bit codes (8 per byte, the longest run) and widths 1..8 in turn (TOP = 8)."""
    import torch

    from meshkern import pca_nf
    from meshkern.triton_kernels import pca_nf as tk
    from orchestration.codecs.pca_nf import nf_code_bytes

    T = 2048
    N = max(1, ROWS // T) * (T - 1)
    out = []
    for H in HIDDEN:
        layouts = {}
        for budget in (15, 30):
            nb = nf_code_bytes(H, budget, True, T)
            bits = pca_nf.allocate_bits(torch.arange(1, H + 1, dtype=torch.float64) ** -1.5, 8 * nb)
            layouts[f"1/{budget}"] = (bits[bits > 0], nb)
        for name, bits in (("ones", torch.ones(H, dtype=torch.int64)), ("1..8", torch.arange(H) % 8 + 1)):
            layouts[name] = (bits, -(-int(bits.sum()) // 8))
        for name, (bits, nb) in layouts.items():
            k, top = bits.numel(), int(bits.max())

            def pack(bits=bits, nb=nb, k=k, top=top):
                tk.pack(_meta(N, k, dtype=torch.float32), _meta(k, 2 ** top - 1, dtype=torch.float32), bits, nb)

            def unpack(bits=bits, nb=nb, k=k, top=top):
                tk.unpack(_meta(N, nb, dtype=torch.uint8), _meta(k, 2 ** top, dtype=torch.float32), bits)
            out.append((f"pca_nf.pack H={H} {name} k={k} B={nb}", pack))
            out.append((f"pca_nf.unpack H={H} {name} k={k} B={nb}", unpack))
    return out


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("float", "fp").replace("bfp16", "bf16")


def collect(archs, only=None) -> list[Job]:
    """Run every case's launcher under each arch; the launches it makes, or its refusal."""
    from meshkern.triton_kernels import _target

    jobs = []
    selected = [(n, t) for n, t in cases() if not only or any(o in n for o in only)]
    for arch in archs:
        for name, thunk in selected:
            with _target.aot_arch(arch), capture() as seen:
                try:
                    thunk()
                except (ValueError, RuntimeError) as e:
                    jobs.append(Job(name, arch, [], refused=str(e)))
                    continue
            jobs.append(Job(name, arch, list(seen)))
    return jobs


# ------------------------------------------------------------------------- compiling
def request(launch: Launch, arch: int) -> dict:
    """The picklable compile request of a launch for an arch, as Triton's launcher would
    make it (signature, constexprs, divisibility attributes, options)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, spec, opts)
    return {"module": fn.fn.__module__, "kernel": fn.fn.__name__, "arch": arch, "signature": signature,
            "constexprs": sorted(constexprs.items()), "attrs": sorted(attrs.items()),
            "num_warps": options.num_warps, "num_stages": options.num_stages, "source_key": fn.cache_key}


def _key(req: dict) -> str:
    import triton

    return hashlib.sha256(repr((sorted(req.items()), triton.__version__)).encode()).hexdigest()[:32]


_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(log: str) -> dict:
    """registers, spill stores/loads, stack frame (bytes) from a ptxas -v log of one kernel."""
    regs, frame = _REGS.search(log), _PTXAS.search(log)
    if regs is None:
        raise ValueError(f"no 'Used N registers' line in the ptxas log:\n{log}")
    stack, stores, loads = (int(x) for x in frame.groups()) if frame else (0, 0, 0)
    return {"regs": int(regs.group(1)), "spill_stores": stores, "spill_loads": loads, "stack": stack}


def compile_one(req: dict) -> dict:
    """Compile ``req`` (see ``request``); {"regs", "spill_stores", "spill_loads", "stack",
    "smem", "seconds"} or {"error": message}. Runs in a worker process."""
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(req["module"]), req["kernel"])
    knobs.nvidia.dump_ptxas_log = True  # Triton runs ptxas -v and prints its log
    knobs.compilation.always_compile = True  # a Triton cache hit would skip ptxas (and the log)
    src = ASTSource(fn, req["signature"], dict(req["constexprs"]), dict(req["attrs"]))
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(src, target=GPUTarget("cuda", req["arch"], 32),
                               options={"num_warps": req["num_warps"], "num_stages": req["num_stages"]})
    except Exception as e:  # the compiler's own error, whatever its type
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    res = parse_ptxas(log.getvalue())
    res.update(smem=int(k.metadata.shared), seconds=round(time.perf_counter() - t0, 2))
    return res


def _cache_dir() -> str:
    return os.environ.get("MESHKERN_COMPILE_CACHE") or os.path.expanduser("~/.cache/meshkern/compile_check")


def compile_all(reqs: dict, jobs: int, use_cache: bool) -> dict:
    """{key: result} for {key: request}, from the cache or compiled in ``jobs`` processes."""
    results, todo = {}, {}
    cache = _cache_dir()
    for key, req in reqs.items():
        path = os.path.join(cache, key + ".json")
        if use_cache and os.path.exists(path):
            with open(path) as f:
                results[key] = json.load(f)
        else:
            todo[key] = req
    def keep(key, res):  # cached as each compile ends: an interrupted run keeps its progress
        results[key] = res
        if "error" not in res:  # errors are recompiled next time (they may be transient)
            os.makedirs(cache, exist_ok=True)
            with open(os.path.join(cache, key + ".json"), "w") as f:
                json.dump(res, f)

    if len(todo) == 1 or (todo and jobs <= 1):  # in this process: no worker start-up (~5 s)
        for key, req in todo.items():
            keep(key, compile_one(req))
    elif todo:
        # spawn: workers import triton afresh (fork after torch/triton init is not safe)
        ctx = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(max_workers=max(1, min(jobs, len(todo))), mp_context=ctx,
                                         initializer=_worker_init) as pool:
            running = {pool.submit(compile_one, req): key for key, req in todo.items()}
            for fut in futures.as_completed(running):
                keep(running[fut], fut.result())
    return results


def _worker_init():
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# --------------------------------------------------------------------------- verdict
def hot(req: dict) -> bool:
    import importlib

    return req["kernel"] in getattr(importlib.import_module(req["module"]), "HOT_KERNELS", ())


def estimate(launch: Launch) -> int | None:
    """The launcher's own shared-memory estimate for this launch (``shared_estimate`` of
    the kernel's module, when it has one), or None."""
    import importlib

    mod = importlib.import_module(launch.fn.fn.__module__)
    est = getattr(mod, "shared_estimate", None)
    return None if est is None else est(launch.fn.fn.__name__, launch.kwargs)


def verdict(res: dict, arch: int, is_hot: bool, est: int | None) -> list[str]:
    """What is wrong with a compile result on ``arch`` (empty: nothing)."""
    from meshkern.triton_kernels._target import SHARED_PER_BLOCK

    if "error" in res:
        return [res["error"]]
    problems = []
    limit = SHARED_PER_BLOCK[arch]
    if res["smem"] > limit:
        problems.append(f"{res['smem']} B shared memory > sm_{arch}'s {limit} B per block")
    if is_hot and (res["spill_stores"] or res["spill_loads"]):
        problems.append("spills in a hot kernel")
    if est is not None and res["smem"] > est:
        problems.append(f"{res['smem']} B shared memory > the launcher's estimate {est} B")
    return problems


def _line(status, job, label, res=None) -> str:
    head = f"{status:<8}{job.case} {label}sm_{job.arch}"
    if res is None or "regs" not in res:
        return head
    spill = res["spill_stores"] + res["spill_loads"]
    return f"{head}: {res['regs']} regs, {spill} B spill, {res['smem']} B smem"


def report(jobs: list[Job], reqs_of: list, results: dict, out=sys.stdout) -> int:
    """Print one line per (configuration, kernel, arch); the number of failures."""
    failures = 0
    for job, reqs in zip(jobs, reqs_of):
        if job.refused is not None:
            print(f"{_line('REFUSED', job, '')}: {job.refused}", file=out)
            continue
        for launch, (key, req) in zip(job.launches, reqs):
            res = results[key]
            label = f"[{req['kernel']} w{req['num_warps']}{' hot' if hot(req) else ''}] "
            problems = verdict(res, job.arch, hot(req), estimate(launch))
            status = "ERROR" if "error" in res else "FAIL" if problems else "OK"
            failures += bool(problems)
            print(_line(status, job, label, res) + (f"  <- {'; '.join(problems)}" if problems else ""), file=out)
    return failures


def run_triton(archs, only, jobs, use_cache) -> int:
    t0 = time.perf_counter()
    os.environ.pop("TRITON_INTERPRET", None)  # compile for GPUs, not the interpreter
    try:
        import triton
    except ImportError:
        print("compile_check: triton is not installed", file=sys.stderr)
        return 2
    if not triton.__version__.startswith("3.7"):
        print(f"compile_check: written against Triton 3.7's launcher internals, found {triton.__version__}",
              file=sys.stderr)
    from meshkern.triton_kernels import jacobi  # noqa: F401 (kernels must be JITFunctions, not interpreted)
    if type(jacobi._jacobi_kernel).__name__ != "JITFunction":
        print("compile_check: kernels were imported under TRITON_INTERPRET=1; run it in a fresh process",
              file=sys.stderr)
        return 2
    jobs_list = collect(archs, only)
    reqs_of, reqs = [], {}
    for job in jobs_list:
        pairs = [(_key(r), r) for r in (request(launch, job.arch) for launch in job.launches)]
        reqs_of.append(pairs)
        reqs.update(pairs)
    results = compile_all(reqs, jobs, use_cache)
    failures = report(jobs_list, reqs_of, results)
    compiled = sum(r.get("seconds", 0) for r in results.values())
    print(f"== {len(jobs_list)} configurations, {len(reqs)} distinct compiles ({compiled:.0f} s of compiling "
          f"if uncached), {failures} failing, {time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton", action="store_true", help="compile every Triton kernel for --arch")
    ap.add_argument("--cuda", action="store_true", help="compile every .cu file with nvcc (minutes)")
    ap.add_argument("--arch", default=",".join(map(str, ARCHS)), help="compute capabilities, e.g. 80,86,89,90")
    ap.add_argument("--only", default="", help="comma-separated substrings of configuration names")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    ap.add_argument("--no-cache", action="store_true", help="recompile even what the result cache holds")
    ap.add_argument("--torch-include", default=None, help="--cuda: a CUDA torch's include/ folder")
    args = ap.parse_args(argv)
    if not (args.triton or args.cuda):
        ap.error("give --triton and/or --cuda")
    archs = tuple(int(a) for a in args.arch.split(",") if a)
    only = [o for o in args.only.split(",") if o]
    rc = 0
    if args.triton:
        rc |= run_triton(archs, only, args.jobs, not args.no_cache)
    if args.cuda:
        from bench import compile_check_cuda

        rc |= compile_check_cuda.run(archs, args.torch_include, args.jobs)
    return rc


if __name__ == "__main__":
    sys.exit(main())
