#!/usr/bin/env bash
# The GPU user's install, executed (issue #42 item 4): from this checkout, into a FRESH venv
# outside it, install PyPI's CUDA build of torch (the version the README names), build
# meshkern's CUDA kernels with nvcc (`pip install --no-build-isolation .`), then check, from
# outside the source tree and without a GPU, that `import meshkern` works and that every op
# with a CUDA kernel (csrc/**/*.cu, the ATen CUDA registration in csrc/spectral/project.cpp)
# or a Triton kernel (meshkern/triton_kernels/) reaches it on CUDA tensors, asking the
# dispatcher and meshkern's backend choice (not the file list), and that the extensions'
# fat binaries hold code for every arch asked for. Runs no kernel: no GPU needed.
#
# DOWNLOADS ~2.8 GB (torch 2.13.0 0.53 GB, its nvidia-* CUDA 13 libraries ~2 GB, triton 0.2 GB,
# then ~50 MB of meshkern's dependencies), fills a ~5 GB venv, and compiles for 6-13 min on 2
# cores: NOT part of .ci/run. Run it by hand before a release or when the CUDA build changes.
# Figures of a run: docs/gpu-install.md.
#
#   scripts/gpu_install_check.sh
#   VENV=~/gpuvenv TORCH_CUDA_ARCH_LIST="8.6" scripts/gpu_install_check.sh
#
# Environment (defaults in brackets):
#   VENV                  the venv to create; must not exist [${TMPDIR:-/tmp}/meshkern-gpu-venv]
#   REUSE_VENV=1          use an existing VENV as is (skips venv + torch install: no download figures)
#   TORCH_SPEC            what `pip install` gets for torch [torch==2.13.0, the README's version]
#   INDEX_URL             the package index [https://pypi.org/simple]
#   TORCH_CUDA_ARCH_LIST  archs nvcc compiles for [8.0;8.6;8.9;9.0+PTX: A100, RTX 30xx, RTX 40xx /
#                         L4 / L40, H100 as SASS; PTX of sm_90 for newer GPUs to JIT]
#   CUDA_HOME             the CUDA toolkit whose nvcc builds [/usr/local/cuda]; its major
#                         version must equal torch.version.cuda's (13 for PyPI's torch 2.13.0)
#   MAX_JOBS              parallel compile jobs [2]
#   KEEP_WORK=1           keep the work folder (source copy, wheel, logs) [removed at exit]
# Pip runs as on a machine with no pip configuration (PIP_CONFIG_FILE=/dev/null, no
# PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL / PIP_CONSTRAINT): a local find-links folder holding a
# CPU torch wheel would otherwise satisfy torch==2.13.0 with it. No pip cache
# (PIP_NO_CACHE_DIR=1), so the download figures are real downloads and no GBs stay behind.
#
# Prints: the download (MB, s), the build time, the wheel size (`pip wheel` of the same tree,
# run first so that it times the compile alone; the install then reuses its objects), the
# installed extension sizes, and one line per op: PASS/FAIL. Exit status 1 when any op that
# should reach a CUDA or Triton kernel does not.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-${TMPDIR:-/tmp}/meshkern-gpu-venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
INDEX_URL="${INDEX_URL:-https://pypi.org/simple}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;8.6;8.9;9.0+PTX}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export MAX_JOBS="${MAX_JOBS:-2}"
export PIP_CONFIG_FILE=/dev/null PIP_NO_CACHE_DIR=1
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_CONSTRAINT PIP_NO_INDEX
T0=$SECONDS
say() { printf '[gpu_install_check %4ss] %s\n' "$((SECONDS - T0))" "$*"; }
# runs "$@" with its output in log $1, after printing the command (the README's install lines
# are these, with $VENV/bin/pip as the activated venv's pip); on failure, the log's tail
logged() {
    local log=$1; shift
    say "\$ $*"
    "$@" >"$log" 2>&1 || { tail -n 60 "$log" >&2; echo "gpu_install_check: failed (log: $log)" >&2; return 1; }
}
WORK="$(mktemp -d)"
if [ "${KEEP_WORK:-0}" = 1 ]; then say "work folder (kept): $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi

# sum of pip's "Downloading NAME (12.3 MB)" lines in a log, in MB
downloaded_mb() {
    grep -o 'Downloading [^ ]* ([0-9.]* [kMG]B)' "$1" | sed 's/.*(\(.*\))/\1/' |
        awk '{m = $2 == "GB" ? 1000 : $2 == "MB" ? 1 : 0.001; s += $1 * m; n++} END {printf "%.0f MB in %d files", s, n}'
}

NVCC="$CUDA_HOME/bin/nvcc"
[ -x "$NVCC" ] || { echo "gpu_install_check: no nvcc at $NVCC (set CUDA_HOME)" >&2; exit 1; }
NVCC_RELEASE="$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
say "nvcc $NVCC_RELEASE ($NVCC), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS"

# the checkout as git sees it (tracked + untracked, not ignored: no build/, *.so, _build_info.json)
SRC="$WORK/src"
mkdir -p "$SRC"
(cd "$ROOT" && git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do
    [ -e "$f" ] && printf '%s\0' "$f"; done | tar --null -T - -cf -) | tar -C "$SRC" -xf -

DL_FIG="not measured (REUSE_VENV=1)"
if [ "${REUSE_VENV:-0}" = 1 ]; then
    [ -x "$VENV/bin/python" ] || { echo "gpu_install_check: REUSE_VENV=1 but no venv at $VENV" >&2; exit 1; }
    say "reusing $VENV"
else
    [ ! -e "$VENV" ] || { echo "gpu_install_check: $VENV exists; remove it, set VENV, or REUSE_VENV=1" >&2; exit 1; }
    say "\$ python3 -m venv $VENV"
    python3 -m venv "$VENV"
    T=$SECONDS
    # --- the GPU user's install: PyPI's CUDA torch (several GB) ---
    logged "$WORK/torch.log" "$VENV/bin/pip" install --index-url "$INDEX_URL" "$TORCH_SPEC"
    DL_FIG="$(downloaded_mb "$WORK/torch.log") in $((SECONDS - T)) s (download + install)"
    say "torch: $DL_FIG"
    T=$SECONDS
    # --- the build tools pyproject's build-system requires (torch is there already) ---
    logged "$WORK/tools.log" "$VENV/bin/pip" install --index-url "$INDEX_URL" setuptools wheel ninja pybind11
    say "build tools: $(downloaded_mb "$WORK/tools.log") in $((SECONDS - T)) s"
fi
PY="$VENV/bin/python"
read -r TORCH_VERSION TORCH_CUDA < <("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>/dev/null)
say "torch $TORCH_VERSION, built for CUDA $TORCH_CUDA"
[ "$TORCH_CUDA" != None ] || { echo "gpu_install_check: $TORCH_VERSION is a CPU build of torch" >&2; exit 1; }
[ "${TORCH_CUDA%%.*}" = "${NVCC_RELEASE%%.*}" ] ||
    { echo "gpu_install_check: torch is built for CUDA $TORCH_CUDA, nvcc is $NVCC_RELEASE: majors differ" >&2; exit 1; }

cd "$SRC"
say "in a copy of the checkout, $SRC; env TORCH_CUDA_ARCH_LIST=\"$TORCH_CUDA_ARCH_LIST\" CUDA_HOME=$CUDA_HOME MAX_JOBS=$MAX_JOBS"
say "the wheel first (a measurement, not an install step): the compile alone, timed"
T=$SECONDS
logged "$WORK/wheel.log" "$VENV/bin/pip" wheel --no-build-isolation --no-deps -w "$WORK/dist" .
BUILD_S=$((SECONDS - T))
WHEEL="$(ls "$WORK"/dist/meshkern-*.whl)"
WHEEL_FIG="$(basename "$WHEEL") $(stat -c %s "$WHEEL" | awk '{printf "%d bytes (%.1f MB)", $1, $1 / 1e6}')"
say "built in $BUILD_S s: $WHEEL_FIG"
T=$SECONDS
# --- the install (reuses the objects the wheel step compiled in this tree) ---
logged "$WORK/install.log" "$VENV/bin/pip" install --index-url "$INDEX_URL" --no-build-isolation .
INSTALL_S=$((SECONDS - T))
say "pip install --no-build-isolation . took $INSTALL_S s ($(downloaded_mb "$WORK/install.log") of dependencies)"

mkdir -p "$WORK/outside" && cd "$WORK/outside"  # nothing of the source tree on sys.path
"$PY" - "$ROOT" <<'PYEOF'
import glob, importlib, json, os, re, sys, warnings
root = sys.argv[1]
warnings.filterwarnings("error", message="meshkern: ")  # an extension that does not load is a failure
import torch
import meshkern
from meshkern import _backend
import meshkern.mask, meshkern.spectral, meshkern.subspace, meshkern.pca, meshkern.pca_nf  # noqa: E401
import meshkern.compress.powersgd_ops  # noqa: F401
import triton

pkg = os.path.dirname(meshkern.__file__)
assert not pkg.startswith(root + os.sep), f"meshkern imported from the source tree: {pkg}"
info = json.load(open(os.path.join(pkg, "_build_info.json")))
print(f"import meshkern OK from {pkg}; torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"torch.cuda.is_available()={torch.cuda.is_available()}")
print(f"_build_info.json: {info}")
loaded = _backend.load_all()
print("extensions loaded:", loaded)
for so in sorted(glob.glob(os.path.join(pkg, "_*_C*.so"))):
    print(f"  {os.path.basename(so)}: {os.path.getsize(so) / 2**20:.2f} MB")
fails = []
if not all(loaded.values()):
    fails.append(f"extensions not loaded: {_backend._problems}")
if set(info["cuda_groups"]) != {"mask", "spectral"}:
    fails.append(f"cuda_groups {info['cuda_groups']}: want mask and spectral (the groups with .cu files)")

def fatbin_archs(path):
    """{(kind, sm)} of the CUDA fat binary in an extension (.nv_fatbin of the ELF): kind is
    SASS (a cubin for that arch) or PTX (JIT-compiled by the driver on newer GPUs)."""
    import struct
    data = open(path, "rb").read()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = secs[shstrndx][4]
    out = set()
    for s in secs:
        if data[names + s[0]:data.index(b"\0", names + s[0])] != b".nv_fatbin":
            continue
        p, stop = s[4], s[4] + s[5]
        while p + 16 <= stop:  # fatbin headers (magic 0xBA55ED50), each followed by its entries
            magic, _, hsize, fsize = struct.unpack_from("<IHHQ", data, p)
            if magic != 0xBA55ED50:
                p += 8
                continue
            q, end = p + hsize, p + hsize + fsize
            while q < end:
                kind, _, ehsize, padded = struct.unpack_from("<HHII", data, q)
                out.add(({1: "PTX", 2: "SASS"}.get(kind, f"kind{kind}"), struct.unpack_from("<I", data, q + 28)[0]))
                q += ehsize + padded
            p = end
    return out

want = set()
for a in os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";"):
    if a:
        sm = int(a.split("+")[0].replace(".", ""))
        want |= {("SASS", sm)} | ({("PTX", sm)} if a.endswith("+PTX") else set())
for group in info["cuda_groups"]:
    so, = glob.glob(os.path.join(pkg, f"{_backend.GROUPS[group]}*.so"))
    got = fatbin_archs(so)
    print(f"  {os.path.basename(so)} device code: " + " ".join(f"{k.lower()}_{sm}" for k, sm in sorted(got)))
    if not want <= got:
        fails.append(f"{os.path.basename(so)} lacks {sorted(want - got)} of TORCH_CUDA_ARCH_LIST")

# The CUDA kernels in C++: every m.impl inside a TORCH_LIBRARY_IMPL(meshkern_C, CUDA, m) block
# of the sources (.cu kernels, and project.cpp's ATen/cuBLAS composition), which must equal
# this table: a kernel added or removed in csrc/ has to be added or removed here too.
CUDA_CPP = {  # meshkern_C op -> (source, the public op(s) that call it)
    "mask_indices": ("csrc/mask/mask_cuda.cu", "meshkern::mask_indices"),
    "mask_pack": ("csrc/mask/mask_cuda.cu", "meshkern::mask_pack"),
    "mask_unpack": ("csrc/mask/mask_cuda.cu", "meshkern::mask_unpack"),
    "sym_eig_jacobi": ("csrc/spectral/jacobi_cuda.cu", "meshkern::sym_eig"),
    "spectral_project_out": ("csrc/spectral/project.cpp (ATen, cuBLAS)", "meshkern::spectral_project(_out)"),
}
in_src = set()
for path in glob.glob(os.path.join(root, "csrc", "**", "*.c*"), recursive=True):
    text = open(path).read()
    for m in re.finditer(r"TORCH_LIBRARY_IMPL\(\s*meshkern_C\s*,\s*CUDA\s*,\s*m\s*\)\s*\{(.*?)\n?\}", text, re.S):
        in_src |= set(re.findall(r'm\.impl\(\s*"(\w+)"', m.group(1)))
if in_src != set(CUDA_CPP):
    fails.append(f"the CUDA_CPP table is out of date: sources register {sorted(in_src)}, table {sorted(CUDA_CPP)}")

def has_kernel(op, key):
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    except RuntimeError:
        return False  # no such op

rows = []  # (status, op, what)
for name, (src, public) in CUDA_CPP.items():
    op = f"meshkern_C::{name}"
    cuda, cpu = has_kernel(op, "CUDA"), has_kernel(op, "CPU")
    ok = cuda and cpu
    rows.append(("PASS" if ok else "FAIL", op, f"dispatcher: CUDA kernel {'yes' if cuda else 'NO'}, CPU kernel "
                 f"{'yes' if cpu else 'NO'}; {src}; called by {public}"))

# The public ops (torch.library.custom_op in namespace meshkern, registered once for every
# device: CompositeExplicitAutograd) choose their kernel per call in meshkern/_backend.py.
# Each must be reachable with CUDA tensors and resolve to a GPU kernel, not the reference.
cuda_dev = torch.device("cuda")
PUBLIC = {  # public op -> (backend group, the backend "auto" must pick on CUDA, Triton module)
    "mask_indices": ("mask", "cuda", "mask"), "mask_pack": ("mask", "cuda", "mask"),
    "mask_unpack": ("mask", "cuda", "mask"),
    "sym_eig": ("spectral", "cuda", "jacobi"), "spectral_project": ("spectral", "cuda", "projection"),
    "spectral_project_out": ("spectral", "cuda", "projection"),
    "subspace_encode": ("subspace", "triton", "subspace"), "subspace_decode": ("subspace", "triton", "subspace"),
    "pca_encode": ("pca", "triton", "pca"), "pca_decode": ("pca", "triton", "pca"),
    "pca_nf_encode": ("pca_nf", "triton", "pca_nf"), "pca_nf_decode": ("pca_nf", "triton", "pca_nf"),
}
for name, (group, want, tmod) in PUBLIC.items():
    op = f"meshkern::{name}"
    reach = torch._C._dispatch_has_computed_kernel_for_dispatch_key(op, "CUDA")
    got = meshkern.pca_nf._which(cuda_dev, "auto") if group == "pca_nf" else _backend.resolve(group, cuda_dev)
    mod = importlib.import_module(f"meshkern.triton_kernels.{tmod}")
    jit = sorted(k for k, v in vars(mod).items() if isinstance(v, triton.runtime.jit.JITFunction))
    ok = reach and got == want and bool(jit)
    rows.append(("PASS" if ok else "FAIL", op, f"dispatcher: CUDA tensors reach it {'yes' if reach else 'NO'}; "
                 f"auto backend on CUDA: {got} (want {want}); Triton {tmod}.py: {len(jit)} kernels"))

# For the record, not failures: ops with no GPU kernel of their own.
notes = ["meshkern::randomized_svd: no kernel of its own (torch matmuls + meshkern::sym_eig)",
         f"meshkern::powersgd_ef_project / powersgd_reconstruct: no CUDA/Triton kernel by design; on CUDA: "
         f"{meshkern.compress.powersgd_ops._kernel_backend(cuda_dev, 'auto')} (cuBLAS)",
         "meshkern/triton_kernels/philox.py: called by no op (tests compare it with tl.randint4x and the C++ Philox)"]
print(f"\n{'':4} {'op':34} check")
for status, op, what in rows:
    print(f"{status:4} {op:34} {what}")
for n in notes:
    print(f"NOTE {n}")
fails += [op for status, op, _ in rows if status != "PASS"]
if fails:
    print(f"\nFAILED: {fails}")
    sys.exit(1)
print(f"\nall {len(rows)} ops OK")
PYEOF
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
say "SUMMARY ($(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))"
say "  torch $TORCH_VERSION (CUDA $TORCH_CUDA) download: $DL_FIG; venv now $(du -sm "$VENV" | cut -f1) MB, of which nvidia + cuda libs $(du -smc "$SITE"/nvidia "$SITE"/cuda* 2>/dev/null | tail -n1 | cut -f1) MB"
say "  build (pip wheel, nvcc $NVCC_RELEASE, archs $TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS): $BUILD_S s; wheel $WHEEL_FIG"
say "  pip install --no-build-isolation .: $INSTALL_S s"
say "OK: every op with a CUDA or Triton kernel reaches it on CUDA tensors"
