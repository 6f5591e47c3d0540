"""Share of dense's gain at step 200 of the deployed pcanf model (seed 0), and of it with
position 0's int8 round trip (`sink`), the projection on the basis's span (`span`) or both
(`span+sink`) kept at the boundary; and what the same transforms do to the base model and to
the dense-trained model (through the pcanf run's basis).

    python results/sink-check/shares.py      # from the repository root; prints three markdown tables

The third table puts python's seed 1 (re-run at step 200, issue #43) beside its seed 0, each
seed's share against the dense record of the same seed, and their mean ± sample sd.

share = (base - loss) / (base - dense); base and dense (step 200) from the tracked seed-0 dense
record of each domain's long runs; the pcanf losses from the step-200 mismatch files (their
`deployed` is the step-200 held-out loss, on the same 32 held-out rows as the records).
"""
import json
import os

R = "results/"
DOMAINS = {  # domain: tracked dense s0 record, tracked pcanf s0 record, pcanf step-200 mismatch,
    #           base-model mismatch, dense step-200 mismatch through the pcanf basis
    "python": (R + "real-long/records/dense-s0.json", R + "real-long/records/pcanf-s0.json",
               R + "sink-check/mismatch-pcanf-s0-python-step200.jsonl",
               R + "far-locales-long/base-mismatch-python.jsonl",
               R + "sink-check/mismatch-dense-s0-python-step200-pcanfbasis.jsonl"),
    "prose": (R + "real-prose-long/records/dense-s0.json", R + "real-prose-long/records/pcanf-s0.json",
              R + "sink-check/mismatch-pcanf-s0-prose-step200.jsonl",
              R + "far-locales-long/base-mismatch-prose.jsonl",
              R + "sink-check/mismatch-dense-s0-prose-step200-pcanfbasis.jsonl"),
    "locales": (R + "far-locales-long/records/dense-s0.json", R + "far-locales-long/records/pcanf-s0.json",
                R + "far-locales-long/mismatch-pcanf-s0-step200-spansink.jsonl",
                R + "far-locales-long/mismatch-pcanf-s0-step0.jsonl",
                R + "far-locales-long/mismatch-dense-s0-pcanfbasis.jsonl"),
}

# python per seed: (tracked dense record, tracked pcanf record, pcanf step-200 mismatch)
PYTHON_SEEDS = {
    0: DOMAINS["python"][:3],
    1: (R + "real-long/records/dense-s1.json", R + "real-long/records/pcanf-s1.json",
        R + "sink-check/mismatch-pcanf-s1-python-step200.jsonl"),
}
COLS = ("deployed", "codec on", "+sink", "+span+sink")


def at(rec, step):
    return next(c["loss"] for c in rec["curve"] if c["step"] == step)


def losses(path, step):
    if not os.path.isfile(path):
        return None
    recs = [json.loads(x) for x in open(path) if x.strip()]
    return next((r["loss"] for r in recs if r["step"] == step), None)


def fmt(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


def mean_sd(xs):
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
    return m, sd


def step200(label, dense_f, pcanf_f, mis_f):
    """(base, dense @200, [deployed, codec on, +sink, +span+sink] losses, the mismatch losses) of
    one pcanf model at step 200, or None (a table row saying so printed) without its mismatch file."""
    L = losses(mis_f, 200)
    if L is None:
        print(f"| {label} | (no {mis_f}) |")
        return None
    dense, pcanf = json.load(open(dense_f)), json.load(open(pcanf_f))
    base, d = dense["base_loss"], at(dense, 200)
    assert abs(L["deployed"] - at(pcanf, 200)) < 1e-6, (label, L["deployed"], at(pcanf, 200))
    return base, d, [L["deployed"], L.get("codec", pcanf["codec_on_loss"]), L["sink"], L["span+sink"]], L


def python_seeds():
    """python's step-200 losses and shares of dense's gain per seed, and their mean ± sample sd."""
    print("| python, seed | base | dense @200 | pcanf @200, deployed | codec on | +sink | +span+sink "
          "| share of dense's gain: deployed / codec on / +sink / +span+sink "
          "| sink / span / span+sink / codec - deployed |")
    print("|---|---|---|---|---|---|---|---|---|")
    shares = []
    for seed, (dense_f, pcanf_f, mis_f) in PYTHON_SEEDS.items():
        got = step200(seed, dense_f, pcanf_f, mis_f)
        if got is None:
            continue
        base, d, cols, L = got
        sh = [100 * (base - x) / (base - d) for x in cols]
        shares.append(sh)
        print(f"| {seed} | {base:.4f} | {d:.4f} | " + " | ".join(fmt(x) for x in cols) + " | "
              + " / ".join(f"{x:.1f}%" for x in sh) + " | "
              + " / ".join(fmt(L[k] - L["deployed"], "+.4f") for k in ("sink", "span", "span+sink", "codec")) + " |")
    if len(shares) > 1:
        ms = [mean_sd([sh[i] for sh in shares]) for i in range(len(COLS))]
        print(f"| mean of {len(shares)} seeds | | | | | | | "
              + " / ".join(f"{m:.1f} ± {sd:.1f}%" for m, sd in ms) + " | |")


def main():
    print("| domain | base | dense @200 | pcanf @200, deployed | codec on | +sink | +span+sink "
          "| share of dense's gain: deployed / codec on / +sink / +span+sink |")
    print("|---|---|---|---|---|---|---|---|")
    for dom, (dense_f, pcanf_f, mis_f, _, _) in DOMAINS.items():
        got = step200(dom, dense_f, pcanf_f, mis_f)
        if got is None:
            continue
        base, d, cols, _ = got
        print(f"| {dom} | {base:.4f} | {d:.4f} | " + " | ".join(fmt(x) for x in cols) + " | "
              + " / ".join(f"{100 * (base - x) / (base - d):.1f}%" for x in cols) + " |")
    print()
    print("| domain | model | deployed | sink - deployed | span - deployed | span+sink - deployed | codec - deployed |")
    print("|---|---|---|---|---|---|---|")
    for dom, (_, _, mis_f, base_f, dense_f) in DOMAINS.items():
        for name, path, step in (("base", base_f, 0), ("pcanf @200", mis_f, 200), ("dense @200", dense_f, 200)):
            L = losses(path, step)
            if L is None:
                continue
            dep = L["deployed"]
            print(f"| {dom} | {name} | {dep:.4f} | " + " | ".join(
                fmt(None if L.get(k) is None else L[k] - dep, "+.4f") for k in ("sink", "span", "span+sink", "codec"))
                + " |")
    print()
    python_seeds()


if __name__ == "__main__":
    main()
