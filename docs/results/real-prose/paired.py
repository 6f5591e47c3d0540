"""Usage: python docs/results/real-prose/paired.py OUT_DIR [BASE_CODEC_ON.json ...]

The hand table of docs/results.md from OUT_DIR/records/*.json: held-out loss @0/@10/@20
(mean ± sample sd over seeds), paired Δ at step 20 vs the base model, Dense and M95,
codec-on loss, the base model's codec-on loss (from the JSON files of base_codec_on.py),
bytes/token, modeled tok/s, train and eval wall seconds. Rows are paired by seed; a Δ uses
only the seeds both rows have."""
import glob, json, os, statistics as st, sys

out = sys.argv[1]
recs = {}
for p in sorted(glob.glob(os.path.join(out, "records", "*.json"))):
    r = json.load(open(p))
    if r.get("complete"):
        recs.setdefault(r["row"], {})[r["seed"]] = r
base_co = {}
for p in sys.argv[2:]:
    for row, d in json.load(open(p))["rows"].items():
        base_co.setdefault(row, {}).update({int(k): v for k, v in d.items()})


def f(xs, n=3):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    m = st.mean(xs)
    return f"{m:.{n}f}" + (f" ± {st.stdev(xs):.{n}f}" if len(xs) > 1 else "")


def at(r, step):
    return next((c["loss"] for c in r["curve"] if c["step"] == step), None)


def paired(a, b, step=20):
    return [at(recs[a][s], step) - at(recs[b][s], step) for s in sorted(recs[a]) if b in recs and s in recs[b]]


order = [n for n in ("dense", "m95", "m95-ap", "int4", "topk", "bottleneck", "pca4") if n in recs]
hdr = ["row", "seeds", "loss @0 (base)", "loss @10", "loss @20", "Δ vs base @20", "Δ vs Dense @20 (paired)",
       "Δ vs Dense (% of Dense)", "Δ vs M95 @20 (paired)", "codec-on loss @20", "base model codec-on",
       "codec-on: trained − base (paired)", "B/tok PP fwd / bwd", "B/tok anchor", "modeled tok/s @200 Mbps",
       "network-only tok/s", "train wall s", "eval wall s"]
print("| " + " | ".join(hdr) + " |")
print("|" + "---|" * len(hdr))
for n in order:
    rs = recs[n]
    seeds = sorted(rs)
    L = lambda step: [at(rs[s], step) for s in seeds]
    dd = paired(n, "dense")
    pct = [100 * (at(rs[s], 20) - at(recs["dense"][s], 20)) / at(recs["dense"][s], 20)
           for s in seeds if "dense" in recs and s in recs["dense"]]
    co = [rs[s].get("codec_on_loss") for s in seeds]
    bco = [base_co.get(n, {}).get(s) for s in seeds]
    diff = [c - b for c, b in zip(co, bco) if c is not None and b is not None]
    bpt = rs[seeds[0]]["bytes_per_token"]
    cells = [n, ",".join(map(str, seeds)), f(L(0)), f(L(10)), f(L(20)),
             f([at(rs[s], 20) - at(rs[s], 0) for s in seeds], 4),
             "0" if n == "dense" else f(dd, 4), "0" if n == "dense" else f(pct, 2),
             "0" if n == "m95" else (f(paired(n, "m95"), 4) if "m95" in recs else "-"),
             "(= deployed)" if all(c is None for c in co) else f(co, 3),
             "(= base)" if all(c is None for c in co) else f(bco, 3),
             "-" if not diff else f(diff, 3),
             f"{bpt['pp_fwd']:.1f} / {bpt['pp_bwd']:.1f}", f"{bpt['anchor']:.0f}",
             f([rs[s]["modeled_tokens_per_s"] for s in seeds], 0),
             f"{rs[seeds[0]]['network_bound_tokens_per_s']:.0f}",
             f([rs[s]["train_wall_s"] for s in seeds], 0), f([rs[s]["eval_wall_s"] for s in seeds], 0)]
    print("| " + " | ".join(cells) + " |")
print()
for n in order:
    for s in sorted(recs[n]):
        r = recs[n][s]
        a = r.get("anchor") or {}
        extra = (f" anchor applied {a.get('anchor_applied')}/{a.get('anchor_arrivals')}, mean staleness "
                 f"{a.get('anchor_mean_staleness')}" if a else "")
        tl = r.get("train_loss") or []
        print(f"{n} s{s}: train loss first3 {[round(x, 2) for x in tl[:3]]} last3 {[round(x, 2) for x in tl[-3:]]}; "
              f"finished {r['finished_utc']}; code {r['code_version']}{extra}")
