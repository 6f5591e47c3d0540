#!/usr/bin/env bash
# README line 2 / .ci/run, after scripts/install.sh --test: the test suite (pytest -q), and
# beside it, at lower priority, the two checks that need no test process:
#   scripts/ci_install_check.sh           the non-editable install (`pip install .`), run
#                                         from outside the source tree
#   python -m bench.compile_check --triton  every Triton kernel compiled for sm_80/86/89/90
# Why beside, not after: the suite keeps about half of 2 cores busy (measured 2026-12-05:
# 16.5 CPU-min in 15.6 min), mostly waiting on its multi-process runs; the two checks are
# ~4 CPU-min of compiling that fill the idle half at nice 10 instead of adding ~3.5 min
# after it (CI has 20 minutes on 2 cores). Their output goes to logs, printed on failure.
# Exit status: the first failure of pytest, the install check, the compile check.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
LOGS=.venv/logs
mkdir -p "$LOGS"
T0=$SECONDS

# setsid: each check is a process group of its own (a terminal's Ctrl-C reaches pytest, not
# them), which the EXIT trap ends whole (pip's and the trainer's children included)
setsid nice -n 10 scripts/ci_install_check.sh >"$LOGS/ci_install_check.log" 2>&1 &
INSTALL=$!
OMP_WAIT_POLICY=PASSIVE setsid nice -n 10 python -m bench.compile_check --triton >"$LOGS/compile_check.log" 2>&1 &
COMPILE=$!
trap 'kill -- -"$INSTALL" -"$COMPILE" 2>/dev/null' EXIT

pytest -q "$@"
rc_pytest=$?
if [ "$rc_pytest" = 2 ]; then  # pytest interrupted (Ctrl-C, or an error collecting the tests): so are the checks
    echo "[test.sh] pytest was interrupted (exit 2): the install and compile checks are stopped" >&2
    exit 2
fi

report() {  # name pid log: waits for the check; its last line, or its log's tail if it failed
    local name=$1 pid=$2 log=$3 rc=0
    wait "$pid" || rc=$?
    if [ "$rc" = 0 ]; then
        echo "[test.sh] $name: $(tail -n 1 "$log")"
    else
        echo "[test.sh] $name FAILED (exit $rc); the last lines of $log:" >&2
        tail -n 40 "$log" >&2
    fi
    return "$rc"
}
rc_install=0 rc_compile=0
report "install check" "$INSTALL" "$LOGS/ci_install_check.log" || rc_install=$?
report "compile check" "$COMPILE" "$LOGS/compile_check.log" || rc_compile=$?
trap - EXIT  # both reaped: their ids are no longer ours to signal
echo "[test.sh] done in $((SECONDS - T0)) s: pytest exit $rc_pytest, install check exit $rc_install, compile check exit $rc_compile"
for rc in "$rc_pytest" "$rc_install" "$rc_compile"; do
    [ "$rc" = 0 ] || exit "$rc"
done
