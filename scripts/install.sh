#!/usr/bin/env bash
# Creates .venv and installs meshkern into it (editable), printing a progress line every
# 15 s, and only once: a second call in the same clone (README line 2 after line 1) finds
# the stamp of this exact source (setup.py, pyproject.toml, csrc/) and skips the C++ build.
#
#   scripts/install.sh --base-model  # README line 1: also builds the default base model
#                                    # (~/.cache/meshkern) while the C++ extensions compile
#   scripts/install.sh --test        # README line 2 / .ci/run: also the test extras
#                                    # (pyproject's [test], installed by name: no rebuild)
#
# Why --base-model overlaps the two: the three extensions compile one after the other and
# two of them spend most of their time in ONE big translation unit, so one of 2 cores
# idles for about half the build; the base model's pretraining (orchestration.models.pretrain,
# 2 threads) fills it. The first run then finds the model built (or waits for the lock).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
say() { printf '[install %4ss] %s\n' "$((SECONDS - T0))" "$*"; }

# run "$@", printing "$1 ... (still running)" every 15 s; output of "$@" goes to its log
ticking() {
    local what=$1 log=$2; shift 2
    ( while sleep 15; do say "$what ... still running (log: $log)"; done ) &
    local ticker=$! rc=0
    "$@" >"$log" 2>&1 || rc=$?
    kill "$ticker" 2>/dev/null || true
    wait "$ticker" 2>/dev/null || true
    if [ "$rc" != 0 ]; then
        say "$what FAILED (exit $rc); the last lines of $log:"
        tr '\r' '\n' <"$log" | tail -n 30 >&2
    fi
    return "$rc"
}

BASE=0 TEST=0
for a in "$@"; do
    case "$a" in
        --base-model) BASE=1 ;;
        --test) TEST=1 ;;
        *) echo "usage: scripts/install.sh [--base-model] [--test]" >&2; exit 2 ;;
    esac
done

stamp_now() {  # what the install depends on: the build inputs and the interpreter
    { python3 --version; cat setup.py pyproject.toml; find csrc -type f | LC_ALL=C sort | xargs cat; } \
        | sha256sum | cut -d' ' -f1
}
STAMP=.venv/.meshkern-install-stamp
[ -d .venv ] || { say "creating .venv"; python3 -m venv .venv; }
PY=.venv/bin/python
mkdir -p .venv/logs
NOW=$(stamp_now)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$NOW" ] && "$PY" -c "import meshkern, orchestration" 2>/dev/null; then
    say "meshkern is already installed in .venv from this source (nothing to rebuild)"
else
    # 1. torch, the build tools and the runtime dependencies (setup.py RUNTIME_REQUIRES):
    #    the base model build below needs them before meshkern itself is installed.
    RUNTIME=$("$PY" -c "import ast; t = ast.parse(open('setup.py').read()); print(' '.join(e for n in t.body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'RUNTIME_REQUIRES' for e in ast.literal_eval(n.value)))")
    say "1/3 installing torch 2.13.0 (CPU), build tools and: $RUNTIME"
    # shellcheck disable=SC2086
    ticking "1/3 pip install" .venv/logs/pip-deps.log \
        "$PY" -m pip install torch==2.13.0 setuptools wheel ninja pybind11 $RUNTIME
    BG=""
    if [ "$BASE" = 1 ]; then
        say "2/3 building the default base model in the background (log: .venv/logs/base-model.log)"
        # PASSIVE: its 2 OpenMP threads sleep instead of spinning while the compiler holds a core
        OMP_WAIT_POLICY=PASSIVE "$PY" -c "from orchestration.models.paths import default_base_model; print(default_base_model())" \
            >.venv/logs/base-model.log 2>&1 &
        BG=$!
    fi
    say "3/3 compiling meshkern's C++ extensions (mask, spectral, dp, subspace) and installing meshkern (~3 min on 2 idle cores)"
    ticking "3/3 C++ build + pip install -e ." .venv/logs/pip-meshkern.log \
        "$PY" -m pip install --no-build-isolation -e .
    echo "$NOW" >"$STAMP"  # installed: a later call skips the build even if the base model fails below
    if [ -n "$BG" ]; then
        while kill -0 "$BG" 2>/dev/null; do
            last=$(tail -c 300 .venv/logs/base-model.log | tr '\r' '\n' | grep -v '^\s*$' | tail -n 1 || true)
            say "2/3 base model: ${last:-starting}"
            sleep 15
        done
        if ! wait "$BG"; then
            say "2/3 the base model build FAILED; the last lines of .venv/logs/base-model.log:"
            tr '\r' '\n' <.venv/logs/base-model.log | tail -n 30 >&2
            exit 1
        fi
        say "2/3 base model ready: $(tail -n 1 .venv/logs/base-model.log)"
    fi
fi
if [ "$TEST" = 1 ]; then  # by name, not as meshkern[test]: that would build meshkern again
    EXTRAS=$("$PY" -c "import re; t = open('pyproject.toml').read(); print(' '.join(re.findall(r'\"([^\"]+)\"', re.search(r'^test = \[(.*?)\]', t, re.M | re.S).group(1))))")
    say "test extras: $EXTRAS"
    # shellcheck disable=SC2086
    ticking "pip install (test extras)" .venv/logs/pip-test.log "$PY" -m pip install $EXTRAS
fi
if [ "$BASE" = 1 ] && [ -z "${BG:-}" ]; then  # installed before: build the model here if missing
    "$PY" -c "from orchestration.models.paths import default_base_model; default_base_model()"
fi
say "done: activate with '. .venv/bin/activate'"
