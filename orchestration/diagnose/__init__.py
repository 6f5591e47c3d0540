"""Boundary diagnostics: what a stage-boundary codec does to a model, measured without training.

    python -m orchestration.diagnose --model M --data D [--stages 2,3] [--boundaries 10,15]
        [--codecs SPEC ...] [--every-layer] [--out DIR]

For a model and a data source, with the trainer's rows, it reports per stage boundary:
the held-out loss with one transform at that boundary (the real codecs, mean + top-k PCA,
the diagnose-local candidates at <= 1/``--budget`` of the dense bytes), each transform's
gradient error against the dense boundary, the residual stream's activation statistics,
and per Y-split whether the anchor's spectral filter brings the masked circuit's gradient
closer to the dense one. How to run it and how to read it: docs/diagnostics.md.

One job per module:
    cli          the command line, loading, outputs (``main``; ``__main__`` runs it)
    settings     ``Settings`` and the checks that need no model
    run          ``run_diagnostics``: every measurement at every boundary, one report
    model        rows, ``LayerSplit`` (the model cut at every layer), ``forward_loss``
    transforms   ``Transform``; the codecs of orchestration.codecs as transforms
    candidates   the diagnose-local candidate designs (``CANDIDATES``), PCA sweep rows
    stats        activation statistics and the PCA spectrum at a boundary
    gradients    boundary gradients, ``GradProbe`` (gradient error of a transform)
    anchor       ``anchor_diagnostics`` (the spectral filter on the masked gradient)
    report       the text and markdown tables, ``write_outputs``; plots: the PNG figures
    common       the trainer's defaults, ``UsageError``, the progress log

This file re-exports the names other code and the tests use (fit_pca and QuantCodec live
in orchestration.components.calibration and orchestration.codecs; they stay reachable here as before).
"""
from orchestration.components.calibration import fit_pca
from orchestration.codecs import QuantCodec
from orchestration.diagnose.anchor import anchor_diagnostics
from orchestration.diagnose.candidates import (CANDIDATES, SCALE_BYTES, _quant, calibrate, candidate_transforms,
                                               pca_project)
from orchestration.diagnose.cli import main
from orchestration.diagnose.common import UsageError
from orchestration.diagnose.gradients import GradProbe, boundary_gradients
from orchestration.diagnose.model import LayerSplit, forward_loss, load_data, pick_rows
from orchestration.diagnose.run import run_diagnostics
from orchestration.diagnose.settings import Settings
from orchestration.diagnose.stats import activation_stats, spectrum_stats
from orchestration.diagnose.transforms import codec_transform, default_codec_specs, dense_bytes

__all__ = ["CANDIDATES", "SCALE_BYTES", "GradProbe", "LayerSplit", "QuantCodec", "Settings", "UsageError", "_quant",
           "activation_stats", "anchor_diagnostics", "boundary_gradients", "calibrate", "candidate_transforms",
           "codec_transform", "default_codec_specs", "dense_bytes", "fit_pca", "forward_loss", "load_data", "main",
           "pca_project", "pick_rows", "run_diagnostics", "spectrum_stats"]
