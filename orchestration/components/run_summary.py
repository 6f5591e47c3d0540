"""The end-of-run summary as printed: every figure on one row with, on the line below it,
one line saying what it is, and a row saying why the modeled and measured tokens/s
differ. A resumed run's summary separates the whole run (steps, tokens, bytes: counters
restored from the checkpoint; loss from metrics.jsonl) from this invocation (steps,
loss, measured speed).

``summary_rows(s)`` -> [(label, value, explanation)], ``format_summary(s)`` -> the text;
``s`` is the dict orchestration.components.metrics.summarize builds (plus the trainer's additions).
"""
from __future__ import annotations

AXIS_TEXT = {
    "pp_fwd": "activations sent forward between pipeline stages, per trained token",
    "pp_bwd": "activation gradients sent backward between pipeline stages, per trained token",
    "dp": "replica sync (DiLoCo fragments or gradient all-reduce, after the compressor), per trained token",
    "anchor": "traffic between the fast replicas and the anchor row (snapshots, anchor gradients), per trained token",
    "tied": "tied embedding split over first and last stage: its full gradient all-reduced between them every "
            "step (not compressed by the boundary codec), per trained token",
    "export": "checkpoint files sent to the leader's disk by stages on other hosts' disks (the model shard or "
              "adapters, at every checkpoint; none with a shared disk), per trained token",
}


def format_rate(bps: float) -> str:
    """A link rate for people: '200 Mbps', '0.5 Mbps', '64 kbps' (never '0 Mbps')."""
    if bps >= 10e6:
        return f"{bps / 1e6:.0f} Mbps"
    if bps >= 1e6:
        return f"{bps / 1e6:.3g} Mbps"
    return f"{bps / 1e3:.3g} kbps"


def _why_modeled_differs(s: dict) -> str:
    limit = s.get("modeled_limit") or "pipeline"
    rate = format_rate(s["bandwidth_bps"])
    if s.get("links_local", True):
        return (f"measured = this machine: its {s.get('ranks', '')} ranks share its cores, links are local; modeled = "
                f"the same compute times and bytes with a device per rank and {rate} links "
                f"(bound: {limit}). Shared cores make measured lower; slow links make modeled lower")
    return (f"measured = these hosts over the links between them, as they are; modeled = the same compute times and "
            f"bytes with {rate} links (--run.bandwidth-bps; bound: {limit}). Links slower or faster than that, "
            "latency, and hosts sharing cores make them differ")


def summary_rows(s: dict) -> list[tuple[str, str, str]]:
    resumed = s.get("start_step", 0) > 0
    whole = " (whole run)" if resumed else ""
    rows = [
        ("run folder", s.get("run_dir", ""), "config.yaml, metrics.jsonl (one record per step), link_bytes.json, "
                                            "checkpoints/" + (", tensorboard/" if s.get("tensorboard") else "")
                                            + (", wandb/" if s.get("wandb") else "")),
        ("mesh", s["mesh"], "rows = data-parallel replicas, columns = pipeline stages; one process per cell"),
        ("model", s["model"], "the model adapted: its architecture, decoder layers and hidden size H"),
        ("boundary codec", s["codec"], "what crosses a stage boundary, both ways (docs/codecs.md; --boundary.codec)"),
        ("DP sync", s["dp"], "how replicas agree: sync mode + the compressor of what they exchange"),
        (f"steps{whole}", f"{s['steps']}  ({s['tokens']:,} tokens)",
         "optimizer steps; tokens = steps x replicas x batch size x sequence length"),
    ]
    if resumed:
        rows.append(("this invocation", f"steps {s['start_step'] + 1}..{s['steps']} ({s['steps_this']} steps), "
                                        f"resumed from step {s['start_step']}",
                     "what this command ran; the loss and measured speed below marked so are of this part only"))
        if s.get("loss_first_run") is not None:
            rows.append(("loss first -> last (whole run)", f"{s['loss_first_run']:.4f} -> {s['loss_last']:.4f}",
                         "training loss (mean over replicas) of step 1 (metrics.jsonl) and of the last step"))
    label = "loss first -> last" + (" (this invocation)" if resumed else "")
    rows.append((label, f"{s['loss_first']:.4f} -> {s['loss_last']:.4f}",
                 "training loss (mean next-token cross-entropy over replicas) of the first and last step"))
    if s.get("eval_loss") is not None:
        base = s.get("eval_loss_base")
        rows.append(("held-out loss base -> final", (f"{base:.4f} -> " if base is not None else "") + f"{s['eval_loss']:.4f}",
                     "loss on held-out sequences never trained on: the model before training and the final checkpoint"))
        if s.get("eval_loss_plain") is not None:
            rows.append(("held-out loss final, plain model", f"{s['eval_loss_plain']:.4f}",
                         "the final checkpoint without its boundary transform (meshkern_boundary.json: position 0's "
                         "int8 round trip at each boundary layer, which the figure above includes; docs/codecs.md)"))
    if s.get("skipped_steps") is not None:
        rows.append(("skipped / bad steps", f"{s['skipped_steps']} skipped, {s.get('bad_steps', 0)} bad",
                     "replica-steps whose update was skipped (non-finite gradient); steps with a non-finite or "
                     "spiking loss (--train.spike-factor)"))
    if s.get("diverged"):
        rows.append(("stopped", "diverged", "DivergenceError: see the error below"))
    rows.append(("measured tokens/s" + (" (this invocation)" if resumed else ""), f"{s['tokens_per_s']:.1f}",
                 "tokens trained per wall-clock second on this machine"))
    if s.get("modeled_tokens_per_s") is not None:
        rows.append((f"modeled tokens/s @ {format_rate(s['bandwidth_bps'])}", f"{s['modeled_tokens_per_s']:.1f}",
                     "orchestration.distributed.linkmodel's estimate for a mesh of real devices over links of --run.bandwidth-bps"))
        rows.append(("why they differ", "", _why_modeled_differs(s)))
    for a in AXIS_TEXT:
        if a in ("tied", "export") and not s["bytes_per_token"].get(a):
            continue  # untied model, or one stage / one disk: no such traffic
        rows.append((f"bytes/token {a}{whole}", f"{s['bytes_per_token'][a]:.1f}", AXIS_TEXT[a]))
    rows.append(("bytes/token PP (fwd+bwd)", f"{s['bytes_per_token_pp']:.1f}",
                 "both pipeline directions, what the boundary codec shrinks (a dense pipeline sends 2 x H values "
                 "per boundary: 8 x H bytes in fp32, 4 x H in bf16)"))
    ratio = s.get("pp_ratio") or {}
    if ratio.get("float32") is not None:
        rows.append(("PP compression", f"{ratio['float32']:.1f}x vs dense fp32, {ratio['bfloat16']:.1f}x vs dense bf16",
                     "dense pipeline bytes / these bytes, one-off bytes (a pca basis) included; GPUs send bf16, "
                     "so the bf16 figure is the one that counts there"))
    rows.append(("bytes/token total", f"{s['bytes_per_token_total']:.1f}", "every axis: all bytes on the wire / tokens"))
    if s.get("anchor"):
        a = s["anchor"]
        ms = a.get("mean_staleness")
        rows.append((f"anchor updates (replica {a.get('seen_by', 0)})", f"{a.get('applied', 0)} applied of {a.get('arrivals', 0)} arrived, "
                     f"{a.get('rejected', 0)} rejected, mean staleness {'n/a' if ms is None else f'{ms:.1f}'} steps, "
                     + ("no anchor ever linked" if a.get("generation") == 0 else
                        f"link {a.get('link', '?')} (anchor row generation {a.get('generation', '?')})"),
                     "anchor gradients folded into SpectralAdamW; staleness = fast steps since their snapshot"))
    st = s.get("stage_state")
    if st:
        tr, tot = sum(r["trainable"] for r in st), sum(r["total"] for r in st)
        rows.append(("trainable parameters", f"{tr:,} of {tot:,} ({100.0 * tr / max(tot, 1):.2f} %)",
                     "parameters the optimizer updates (LoRA: the adapters; the base weights are frozen) of all "
                     "parameters, replica 0's stages"))
        rows.append(("optimizer state / stage", ", ".join(f"{r['optimizer_bytes'] / 2**20:.2f}" for r in st) + " MiB",
                     "bytes of the inner optimizer's state (AdamW's two moments; SpectralAdamW's anchor state) held "
                     "by each stage of replica 0"))
        rows.append(("peak RSS / stage", ", ".join(f"{r['peak_rss_bytes'] / 2**30:.2f}" for r in st) + " GiB",
                     "the largest resident memory of each stage's process of replica 0 (getrusage; with fork it "
                     "counts the pages shared with the launcher too); compare orchestration.components.memory's table"))
    if s.get("checkpoint"):
        what = ("the final adapters (a PEFT folder: adapter_config.json, adapter_model.safetensors) and optimizer "
                "state" if s.get("adapter_dir") else "the final weights (Hugging Face format) and optimizer state")
        rows.append(("checkpoint", s["checkpoint"], what))
    if s.get("adapter_dir"):
        rows.append(("adapter", s["adapter_dir"], "the run's LoRA adapters for the unsplit model: "
                     "PeftModel.from_pretrained(base, folder); orchestration.evaluate and --model.path read it too"))
    if s.get("merged_dir"):
        rows.append(("merged model", s["merged_dir"], "the base model with the adapters merged in (--adapter.export "
                     "merged), a plain Hugging Face checkpoint"))
    rows.append(("metrics", s["metrics_path"], "every step's record; read with orchestration.components.metrics.read_jsonl"))
    if s.get("links_path"):
        rows.append(("bytes per link", s["links_path"], "bytes each rank sent on each link, per axis"))
    return rows


def format_summary(s: dict, title: str = "meshkern run summary") -> str:
    """The summary table: ``label  value`` and, on the line below, ``- what the figure is``."""
    rows = summary_rows(s)
    w = max(len(k) for k, _, _ in rows)
    lines = [title, "-" * max(len(title), w + 40)]
    for k, v, why in rows:
        lines.append(f"{k:<{w}}  {v}".rstrip())
        lines.append(f"{'':<{w}}  - {why}")
    return "\n".join(lines)
