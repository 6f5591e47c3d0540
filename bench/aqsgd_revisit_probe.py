"""AQ-SGD on a real model without training: how the boundary's loss cost changes as the
same samples are revisited while the activations drift (forward passes only).

    python -m bench.aqsgd_revisit_probe --model smollm2-135m --data corpus:python --boundary 15

The rows and the layer split are orchestration.diagnose's (held-out rows, boundary L =
the hidden state entering decoder layer L). Training is replaced by a stand-in drift:
before each visit after the first, every weight of the layers before L gets Gaussian
noise of ``eps`` times that tensor's std, so h_L changes a little between visits as it
would between epochs of fine-tuning. Per visit it prints the held-out loss of the
drifted model (dense), and with aqsgd (sender and receiver stores, in lockstep) and the
stateless int4 codec at the boundary. The drift is a proxy, not training: what it shows
is how fast the delta coding converges, not what a trained run reaches.
"""
from __future__ import annotations

import argparse

import torch

from meshkern.mask import MaskKey
from orchestration.codecs import apply_codec, make_codec


@torch.no_grad()
def main(argv=None) -> None:
    from orchestration.diagnose.common import EVAL_FRACTION, SPLIT_SEED
    from orchestration.diagnose.model import LayerSplit, forward_loss, load_data, pick_rows, resolve_and_load

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="corpus:python")
    ap.add_argument("--boundary", type=int, default=15)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--visits", type=int, default=4)
    ap.add_argument("--eps", default="0,1e-3,1e-2", help="relative weight noise per visit (comma-separated)")
    ap.add_argument("--codecs", nargs="+", default=["aqsgd:bits=4", "aqsgd:bits=2", "int4"])
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, path = resolve_and_load(a.model)
    _, held = load_data(path, a.data, a.seq_len, eval_fraction=EVAL_FRACTION, split_seed=SPLIT_SEED)
    ids = pick_rows(held, a.rows, 0)
    split = LayerSplit(model)
    L = split.check_boundary(a.boundary)
    prefix_params = [p for _, p in split.named_params(0, L)]
    original = [p.detach().clone() for p in prefix_params]
    H = split.hidden_size
    print(f"# {a.model} boundary {L}, {a.rows}x{a.seq_len} held-out tokens; fwd bytes/token: "
          + ", ".join(f"{c} {make_codec(c).wire_bytes((1, a.seq_len, H), torch.float32, 'fwd') / a.seq_len:.0f}"
                      for c in a.codecs) + f" (dense fp32 {4 * H})")
    for eps in (float(e) for e in a.eps.split(",")):
        for p, o in zip(prefix_params, original):
            p.copy_(o)
        g = torch.Generator().manual_seed(0)
        pairs = {c: (make_codec(c), make_codec(c)) for c in a.codecs}
        for v in range(a.visits):
            if v and eps:
                for p in prefix_params:
                    p.add_(eps * p.std() * torch.randn(p.shape, generator=g))
            h = split.prefix(ids, L)
            dense, _ = forward_loss(split, h, L, ids)
            line = [f"eps={eps:g} visit {v}: dense {dense:.4f}"]
            for c, (send, recv) in pairs.items():
                key = MaskKey(0, L, v, 0)
                if c.startswith("aqsgd"):
                    sids = [torch.arange(ids.shape[0])]
                    send.begin_step(v, sids)
                    recv.begin_step(v, sids)
                    wire, _ = send.encode_fwd(h, key)
                    h_hat = recv.decode_fwd(wire, key, h.shape, h.dtype)
                else:
                    h_hat = apply_codec(send, h, key)
                loss, _ = forward_loss(split, h_hat, L, ids)
                line.append(f"{c} {loss:.4f} ({loss - dense:+.4f})")
            print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
