#!/usr/bin/env bash
# The install that worked here (2026-12-02): a venv from meshkern's interpreter, no system site-packages.
set -euo pipefail
cd "$(dirname "$0")"
"${MESHKERN_PYTHON:-python3}" -m venv venv           # python 3.11.7
venv/bin/pip install torch==2.13.0+cpu              # same as /work/main/.venv; from /opt/wheels (find-links), ~28 s
venv/bin/pip install torchft==0.2.0                 # ~4 s: a manylinux wheel with the Rust _torchft .so; pulls requests, protobuf, opentelemetry-*
venv/bin/pip install numpy                          # only for the probe's parameter digests
