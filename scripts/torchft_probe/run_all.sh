#!/usr/bin/env bash
# Every run quoted in REPORT.md (each 10-60 s on this 2-core machine; 1 thread per process).
set -u
cd "$(dirname "$0")"
P="timeout 250 venv/bin/python proto.py"
$P --outdir runs/ddp1                                          > runs/ddp1.out 2>&1
$P --outdir runs/ddp_mid0_6 --step-ms 0 --kill-at 100 --kill-delay-ms 6 --after 40 > runs/ddp_mid0_6.out 2>&1
$P --outdir runs/ddp_defaults --hb-timeout-ms 5000 --join-ms 60000 --tick-ms 100 > runs/ddp_defaults.out 2>&1
$P --outdir runs/ddp_hb300 --hb-timeout-ms 300                 > runs/ddp_hb300.out 2>&1
$P --outdir runs/ddp_sync --sync-quorum                        > runs/ddp_sync.out 2>&1
$P --outdir runs/ddp_dim1024 --dim 1024 --kill-at 10 --after 5 > runs/ddp_dim1024.out 2>&1
$P --outdir runs/diloco --mode diloco --H 4 --kill-at 10 --after 8 > runs/diloco.out 2>&1
$P --outdir runs/min3 --min-replicas 3 --restart-on-kill       > runs/min3.out 2>&1
$P --outdir runs/pp2 --stages 2                                > runs/pp2.out 2>&1
$P --outdir runs/pp2_kill_s1 --stages 2 --kill-stages 1        > runs/pp2_kill_s1.out 2>&1
$P --outdir runs/pp2_kill_s1_zombie --stages 2 --kill-stages 1 --no-hard-exit > runs/pp2_kill_s1_zombie.out 2>&1
$P --outdir runs/pp2_perstage_lh --stages 2 --per-stage-managers --per-stage-lighthouses > runs/pp2_perstage_lh.out 2>&1
$P --outdir runs/pp2_perstage --stages 2 --per-stage-managers --max-s 40 > runs/pp2_perstage.out 2>&1  # one lighthouse: fails by design
timeout 60 venv/bin/python c10d_compat.py > runs/c10d_compat.txt 2>&1
timeout 60 venv/bin/python c10d_compat.py --with-default-pg > runs/c10d_compat_defaultpg.txt 2>&1
timeout 60 venv/bin/python demo_noauth.py > runs/demo_noauth.txt 2>&1
env -u GLOO_SOCKET_IFNAME timeout 60 venv/bin/python unpatched_listen.py > runs/unpatched_listen.txt 2>&1
venv/bin/python show.py runs/ddp1 runs/ddp_mid0_6 runs/ddp_defaults runs/ddp_hb300 runs/ddp_sync runs/ddp_dim1024 \
  runs/diloco runs/min3 runs/pp2 runs/pp2_kill_s1 runs/pp2_kill_s1_zombie runs/pp2_perstage_lh
