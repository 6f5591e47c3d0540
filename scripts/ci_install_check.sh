#!/usr/bin/env bash
# CI step (issue #14 item 1): install meshkern NON-editable with `pip install .` (build
# isolation, as a user would) into a fresh venv, then, from outside the source tree, check
# that the runtime torch is exactly the one the extensions were built for, that every
# compiled extension loads (no fallback to the pure-torch reference) and that the trainer
# runs a few steps on a tiny model without the fallback warning, and elastically with torchft
# added as a user adds it. ~2-4 min (one C++ build).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
T0=$SECONDS
python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q "$ROOT" 2> >(grep -v "^WARNING: Location" >&2)
echo "ci_install_check: pip install . took $((SECONDS - T0)) s" >&2
cd "$WORK"  # nothing of the source tree on sys.path from here on
"$PY" - "$ROOT" <<'PYEOF'
import json, os, sys
import torch
import meshkern
from meshkern import _backend
root = sys.argv[1]
assert not os.path.abspath(meshkern.__file__).startswith(root + os.sep), f"meshkern imported from the source tree: {meshkern.__file__}"
info = json.load(open(os.path.join(os.path.dirname(meshkern.__file__), "_build_info.json")))
assert info["torch"] == torch.__version__, f"extensions built for torch {info['torch']}, pip installed {torch.__version__}"
loaded = _backend.load_all()
assert loaded and all(loaded.values()), f"extensions not loaded: {_backend._problems}"
assert _backend.resolve("mask", torch.device("cpu")) == "cpp"
# a tiny Llama + BPE tokenizer for the trainer run below
from transformers import LlamaConfig, LlamaForCausalLM
from orchestration.data.tokens import train_bpe
import glob, sysconfig
text = "\n".join(open(f).read() for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py"))))[:60000]
open("data.txt", "w").write(text)
tok = train_bpe([text], vocab_size=300)
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=40, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).save_pretrained("tiny")
tok.save_pretrained("tiny")
print(f"installed meshkern at {os.path.dirname(meshkern.__file__)}, torch {torch.__version__}, extensions {sorted(loaded)} loaded")
PYEOF
"$PY" -m orchestration.train --model tiny --data data.txt --data.seq-len 32 --data.max-sequences 64 \
    --train.batch-size 4 --train.microbatches 2 --train.steps 3 --mesh.rows 1 --mesh.stages 2 \
    --boundary.codec mask --run.out-dir runs --run.name ci --run.progress false --run.eval-sequences 0 \
    >train.out 2>train.err || { cat train.out train.err; echo "ci_install_check: the trainer failed" >&2; exit 1; }
if grep -q "extension unavailable" train.err; then
    cat train.err; echo "ci_install_check: the trainer fell back to the pure-torch reference" >&2; exit 1
fi
grep -q '"step": 3' runs/ci/metrics.jsonl
# torchrun as the docs tell users to start each machine (the installed meshkern-torchrun: its
# store bound to --master-addr), the default codec: its checkpoint carries the sink transform
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
OMP_NUM_THREADS=1 "$WORK/venv/bin/meshkern-torchrun" --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 \
    --master-port "$PORT" -m orchestration.train --model tiny --data data.txt --data.seq-len 32 \
    --data.max-sequences 64 --train.batch-size 4 --train.microbatches 2 --train.steps 3 --mesh.rows 1 \
    --mesh.stages 2 --run.out-dir runs --run.name ci-torchrun --run.progress false --run.eval-sequences 0 \
    >torchrun.out 2>torchrun.err || { cat torchrun.out torchrun.err; echo "ci_install_check: the torchrun run failed" >&2; exit 1; }
ls runs/ci-torchrun/checkpoints/step_00000003/meshkern_boundary.json >/dev/null \
    || { cat torchrun.out; echo "ci_install_check: no boundary transform in the pca run's checkpoint" >&2; exit 1; }
# elastic replicas from the installed package: torchft as a user adds it, the lighthouse
# started as `python -m orchestration.elastic.lighthouse` from the venv, 2 replicas x 2 stages
"$PY" -m pip install -q torchft==0.2.0 2> >(grep -v "^WARNING: Location" >&2)
"$PY" -m orchestration.train --model tiny --data data.txt --data.seq-len 32 --data.max-sequences 64 \
    --train.batch-size 4 --train.microbatches 2 --train.steps 3 --mesh.rows 2 --mesh.stages 2 --mesh.elastic \
    --boundary.codec mask --run.out-dir runs --run.name ci-elastic --run.progress false --run.eval-sequences 0 \
    >elastic.out 2>elastic.err || { cat elastic.out elastic.err; echo "ci_install_check: the elastic run failed" >&2; exit 1; }
grep -q "^elastic: 2-2 replicas per step" elastic.out || { cat elastic.out elastic.err; echo "ci_install_check: no elastic summary" >&2; exit 1; }
echo "ci_install_check: OK in $((SECONDS - T0)) s (non-editable install, torch $("$PY" -c 'import torch; print(torch.__version__)'), compiled backend in use, 3 trainer steps, 3 under meshkern-torchrun, 3 elastic steps)"
