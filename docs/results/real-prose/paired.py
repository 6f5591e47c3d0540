"""Usage: python docs/results/real-prose/paired.py OUT_DIR[=TAG] ... [BASE_CODEC_ON.json ...]

The hand table of docs/results.md from OUT_DIR/records/*.json (several OUT_DIRs: their
records together; a row from OUT_DIR=TAG is named "ROW TAG"): held-out loss at every
evaluation (mean ± sample sd over seeds), paired Δ at the last step vs the base model, Dense and M95,
codec-on loss, the base model's codec-on loss (from the JSON files of base_codec_on.py),
bytes/token, modeled tok/s, train and eval wall seconds. Rows are paired by seed; a Δ uses
only the seeds both rows have."""
import glob, json, os, statistics as st, sys

recs = {}
for arg in (a for a in sys.argv[1:] if not a.endswith(".json")):
    out, _, tag = arg.partition("=")
    for p in sorted(glob.glob(os.path.join(out, "records", "*.json"))):
        r = json.load(open(p))
        if r.get("complete"):
            recs.setdefault(r["row"] + (f" {tag}" if tag else ""), {})[r["seed"]] = r
base_co = {}
for p in (a for a in sys.argv[1:] if a.endswith(".json")):
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


END = max(c["step"] for rs in recs.values() for r in rs.values() for c in r["curve"])
STEPS = sorted({c["step"] for rs in recs.values() for r in rs.values() for c in r["curve"]})


def paired(a, b, step=END):
    pairs = [(at(recs[a][s], step), at(recs[b][s], step)) for s in sorted(recs[a]) if b in recs and s in recs[b]]
    return [x - y for x, y in pairs if x is not None and y is not None]


known = ("dense", "dp", "m95", "m90-ap", "m95-ap", "delay20", "int4", "topk", "bottleneck", "pca4", "pca4-ap")
order = [n for n in known if n in recs] + sorted(n for n in recs if n not in known)
hdr = ["row", "seeds", "loss @0 (base)"] + [f"loss @{t}" for t in STEPS if t] + [
       f"Δ vs base @{END}", f"Δ vs Dense @{END} (paired)", "Δ vs Dense (% of Dense)", f"Δ vs M95 @{END} (paired)", f"codec-on loss @{END}", "base model codec-on",
       "codec-on: trained − base (paired)", "B/tok PP fwd / bwd", "B/tok DP", "B/tok anchor", "B/tok tied", "modeled tok/s @200 Mbps",
       "network-only tok/s", "train wall s", "eval wall s"]
print("| " + " | ".join(hdr) + " |")
print("|" + "---|" * len(hdr))
for n in order:
    rs = recs[n]
    seeds = sorted(rs)
    L = lambda step: [at(rs[s], step) for s in seeds]
    dd = paired(n, "dense")
    pct = [100 * (at(rs[s], END) - at(recs["dense"][s], END)) / at(recs["dense"][s], END)
           for s in seeds if "dense" in recs and s in recs["dense"]]
    co = [rs[s].get("codec_on_loss") for s in seeds]
    bco = [base_co.get(n, {}).get(s) for s in seeds]
    diff = [c - b for c, b in zip(co, bco) if c is not None and b is not None]
    bpt = rs[seeds[0]]["bytes_per_token"]
    cells = [n, ",".join(map(str, seeds))] + [f(L(t)) for t in STEPS] + [
             f([at(rs[s], END) - at(rs[s], 0) for s in seeds], 4),
             "0" if n == "dense" else (f(dd, 4) if "dense" in recs else "-"),
             "0" if n == "dense" else (f(pct, 2) if "dense" in recs else "-"),
             "0" if n == "m95" else (f(paired(n, "m95"), 4) if "m95" in recs else "-"),
             "(= deployed)" if all(c is None for c in co) else f(co, 3),
             "(= base)" if all(c is None for c in co) else f(bco, 3),
             "-" if not diff else f(diff, 3),
             f"{bpt['pp_fwd']:.1f} / {bpt['pp_bwd']:.1f}", f"{bpt['dp']:.1f}", f"{bpt['anchor']:.0f}",
             "not counted" if "tied" not in bpt else f"{bpt['tied']:.0f}",
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
