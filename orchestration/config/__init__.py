"""Run configuration: typed dataclasses, flags, files, presets and validation.

Modules: job_config (the dataclasses, their defaults and help, the named choices),
manager (flags, YAML/JSON files, presets: parse_args, from_dict, normalize), validate
(every rule on a config, before any rank starts), cli_help (the --help text's examples
and lists) and presets/ (the published rows). The names below are the package's API.
"""
from orchestration.config.job_config import (ALIASES, ANCHOR_TRANSPORTS, COMPRESSORS, RENAMED, SECTIONS,
                                             SNAPSHOT_CODECS, AdapterConfig, AnchorConfig, BoundaryConfig,
                                             CheckpointConfig, Config,
                                             DataConfig, DPConfig, MeshConfig, ModelConfig, RunConfig, TrainConfig,
                                             flag_name)
from orchestration.config.manager import (HETEROGENEOUS_DEFAULTS, PRESET_DIR, apply_dict, build_parser, from_dict,
                                          load_file, load_preset, normalize, parse_args, presets, to_yaml)
from orchestration.config.validate import ineffective_settings, validate

__all__ = ["ALIASES", "ANCHOR_TRANSPORTS", "COMPRESSORS", "RENAMED", "SECTIONS", "SNAPSHOT_CODECS", "AdapterConfig",
           "AnchorConfig",
           "BoundaryConfig", "CheckpointConfig", "Config", "DataConfig", "DPConfig", "MeshConfig", "ModelConfig",
           "RunConfig", "TrainConfig", "flag_name", "HETEROGENEOUS_DEFAULTS", "PRESET_DIR", "apply_dict",
           "build_parser", "from_dict", "load_file", "load_preset", "normalize", "parse_args", "presets", "to_yaml",
           "ineffective_settings", "validate"]
