"""Builds a :class:`Config` from defaults, presets, YAML/JSON files and CLI flags.

Precedence, lowest first: dataclass defaults < ``--preset NAME`` (orchestration/config/presets/
NAME.yaml) < ``--config FILE`` (YAML or JSON) < individual flags. Every field is a flag
``--section.field`` (e.g. ``--mesh.rows 4``, ``--boundary.p 0.9``); a few common ones also
have a short alias (``--model``, ``--data``, ``--steps``, ``--resume``). Flags join words
with dashes like every other entry point (``--data.seq-len``); the field's own spelling
(``--data.seq_len``) is accepted as well. ``--help`` lists
all of them with their defaults.

Parsing also settles what the settings imply (``normalize``: rows and stages from
``--mesh.replicas``, a codec spec's options), so that ``validate`` only checks.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from typing import Any

from orchestration.config.job_config import ALIASES, RENAMED, SECTIONS, Config, flag_name
from orchestration.config.validate import validate

PRESET_DIR = os.path.join(os.path.dirname(__file__), "presets")
# With --mesh.replicas, unless a preset, config file or flag sets them: the paper's DP sync
# (SparseLoCo, whose error feedback replaces DiLoCo's outer momentum) and selective boundaries
# (the codec stays the default pca, which calibrates every replica's cuts).
HETEROGENEOUS_DEFAULTS = {("dp", "compressor"): "sparseloco", ("boundary", "compress"): "selective"}

def _hints(section_cls) -> dict:
    return typing.get_type_hints(section_cls)


def _coerce(value: Any, typ, where: str):
    """Converts a YAML/JSON/CLI value to the field's type, or raises a ValueError naming ``where``."""
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
        if typ is list:
            if isinstance(value, str):
                value = [v for v in value.replace(" ", "").split(",") if v]
            return [int(v) for v in value]
        if typ is dict:
            if isinstance(value, str):
                value = json.loads(value) if value.strip() else {}
            if not isinstance(value, dict):
                raise ValueError
            return dict(value)
    except (ValueError, TypeError, json.JSONDecodeError):
        pass
    raise ValueError(f"{where}: cannot use {value!r} as {typ.__name__}")


def apply_dict(cfg: Config, d: dict, where: str) -> None:
    """Overrides ``cfg`` in place with a nested dict {section: {field: value}}; unknown keys are errors."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping of sections, got {type(d).__name__}")
    for sec, vals in d.items():
        if sec == "preset":
            cfg.preset = str(vals)
            continue
        if sec not in SECTIONS:
            raise ValueError(f"{where}: unknown section {sec!r}; known: {', '.join(SECTIONS)}")
        if not isinstance(vals, dict):
            raise ValueError(f"{where}: section {sec!r} must be a mapping")
        obj = getattr(cfg, sec)
        hints = _hints(type(obj))
        for k, v in vals.items():
            k = RENAMED.get((sec, k), k)
            if k not in hints:
                known = ", ".join(f.name for f in dataclasses.fields(obj))
                raise ValueError(f"{where}: unknown field {sec}.{k}; known in {sec}: {known}")
            setattr(obj, k, _coerce(v, hints[k], f"{where}: {sec}.{k}"))


def load_file(path: str) -> dict:
    """Reads a YAML or JSON config file into a nested dict, whatever its name ends with
    (recognised by content: YAML 1.1 reads JSON too); clear error if missing or malformed."""
    if not os.path.isfile(path):
        raise ValueError(f"config file not found: {path}")
    with open(path) as f:
        text = f.read()
    try:
        import yaml

        d = yaml.safe_load(text)
    except ImportError:  # pyyaml is a dependency, but JSON needs nothing
        d = None
    except Exception as e:  # yaml.YAMLError: try JSON before naming the file
        try:
            d = json.loads(text)
        except ValueError:
            raise ValueError(f"config file {path} is neither valid YAML nor JSON: {e}") from None
    if d is None and text.strip():
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ValueError(f"config file {path} is not valid JSON (and pyyaml is missing): {e}") from None
    if d is not None and not isinstance(d, dict):
        raise ValueError(f"config file {path} holds a {type(d).__name__}, not a mapping of sections "
                         f"({', '.join(SECTIONS)}) as --print-config writes")
    return d or {}


def presets() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".yaml"))


def load_preset(name: str) -> dict:
    path = os.path.join(PRESET_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(presets())}")
    return load_file(path)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's parser: usage, examples and built-ins from orchestration.config.cli_help,
    then one group per section; fields with ``hidden=True`` (test-only) are accepted, not listed."""
    from orchestration.config import cli_help

    ap = cli_help.TrainParser(
        prog=cli_help.PROG, usage=cli_help.USAGE, formatter_class=cli_help.Formatter,
        description="Adapt a causal LM on an X x Y mesh of processes (rows: replicas, columns: pipeline "
        "stages)\nwith compressed stage boundaries and compressed DP sync. Every config field is a flag "
        "--SECTION.FIELD;\nprecedence: defaults < --preset < --config < flags.\n\n" + cli_help.EXAMPLES,
        epilog=cli_help.epilog_builtins())
    g0 = ap.add_argument_group("run selection")
    g0.add_argument("--preset", default=None, metavar="NAME", help=f"a published row: {', '.join(presets())}")
    g0.add_argument("--config", default=None, metavar="FILE", help="YAML or JSON file {section: {field: value}}")
    g0.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    g0.add_argument("--dry-run", action="store_true", help="check the model and mesh, print the memory each stage "
                    "needs (weights, gradients, optimizer state, activations) and exit without training")
    inv = {v: k for k, v in ALIASES.items()}
    defaults = Config()
    for sec in SECTIONS:
        obj = getattr(defaults, sec)
        g = ap.add_argument_group(f"--{sec}.*", cli_help.SECTIONS_HELP.get(sec))
        for f in dataclasses.fields(obj):
            dotted = f"{sec}.{f.name}"
            names = [flag_name(sec, f.name)] + ([f"--{inv[dotted]}"] if dotted in inv else [])
            default = getattr(obj, f.name)
            flag = {"nargs": "?", "const": "true"} if isinstance(default, bool) else {}  # bare --flag means true
            kw = dict(dest=dotted, default=None, metavar=type(default).__name__.upper(), **flag)
            text = f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%")
            g.add_argument(*names, **kw, help=argparse.SUPPRESS if f.metadata.get("hidden") else text)
            hidden = [f"--{dotted}"] if f"--{dotted}" != names[0] else []  # the field's spelling: --data.seq_len
            hidden += [f"--{sec}.{old}" for (s_, old), new in RENAMED.items() if s_ == sec and new == f.name]
            if hidden:  # accepted, not listed
                g.add_argument(*hidden, **kw, help=argparse.SUPPRESS)
    return ap


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """Builds the Config from defaults, preset, file and flags (in that order), settles
    what they imply (``normalize``) and validates it."""
    ap = build_parser()
    ns = ap.parse_args(argv)
    cfg = Config()
    given: list[dict] = []
    if ns.preset:
        given.append(load_preset(ns.preset))
        apply_dict(cfg, given[-1], where=f"preset {ns.preset}")
        cfg.preset = ns.preset
    if ns.config:
        given.append(load_file(ns.config))
        apply_dict(cfg, given[-1], where=ns.config)
    over: dict = {}
    for dotted, v in vars(ns).items():
        if "." in dotted and v is not None:
            sec, k = dotted.split(".", 1)
            over.setdefault(sec, {})[k] = v
    apply_dict(cfg, over, where="command line")
    named = {(sec, k.replace("-", "_")) for d in [*given, over] for sec, sub in d.items()
             if isinstance(sub, dict) for k in sub}
    if cfg.mesh.replicas:
        _heterogeneous_defaults(cfg, named)
    normalize(cfg)
    validate(cfg)
    return cfg, ns


def _heterogeneous_defaults(cfg: Config, named: set) -> None:
    """A heterogeneous mesh's own defaults, for what no preset, file or flag set; each of
    --mesh.rows / --mesh.stages that was given must agree with --mesh.replicas."""
    reps = list(cfg.mesh.replicas)
    for k, v in (("rows", cfg.replicas_rows), ("stages", max(reps))):
        if ("mesh", k) in named and getattr(cfg.mesh, k) != v:
            raise ValueError(f"--mesh.replicas {','.join(map(str, reps))} makes a mesh of {len(reps)} replicas of up "
                             f"to {max(reps)} stages{' and the anchor row' if cfg.anchor.enabled else ''}; it "
                             f"conflicts with --mesh.{k} {getattr(cfg.mesh, k)} (give one or the other)")
    fill: dict = {}
    for (sec, k), v in HETEROGENEOUS_DEFAULTS.items():
        if (sec, k) not in named:
            fill.setdefault(sec, {})[k] = v
    apply_dict(cfg, fill, where="heterogeneous-mesh defaults")


def normalize(cfg: Config) -> Config:
    """Settles, in place, what the settings imply, so that ``validate`` only checks:
    --mesh.rows / --mesh.stages from --mesh.replicas, and a --boundary.codec spec
    ``name:key=value,...`` split into the name and its options (--boundary.options win).
    Idempotent; returns ``cfg``."""
    m, b = cfg.mesh, cfg.boundary
    if m.replicas:  # with the anchor, its row comes last (of the deepest replicas' split)
        m.rows, m.stages = cfg.replicas_rows, max(m.replicas)
    if ":" in b.codec:
        from orchestration.codecs import parse_spec

        try:
            name, spec_options = parse_spec(b.codec)
        except ValueError as e:
            raise ValueError(f"--boundary.codec: {e}") from None
        b.codec, b.options = name, {**spec_options, **b.options}
    return cfg


def from_dict(d: dict) -> Config:
    """The Config a nested dict {section: {field: value}} describes (``Config.to_dict``,
    a config file, a checkpoint's config), normalized like parsed flags; not validated."""
    cfg = Config()
    apply_dict(cfg, d, where="config")
    return normalize(cfg)


def to_yaml(cfg: Config) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
