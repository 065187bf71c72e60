"""The trainer's `--config` file: argument values from YAML or JSON, checked against the
arguments' dataclass fields (names and types) before any of them is used."""

from __future__ import annotations

import dataclasses
import json
import os

__all__ = ["read_config_file"]


def read_config_file(path: str, fields: dict[str, dataclasses.Field]) -> dict:
    """Values of `fields` (a dataclass's, by name) from a `.json`, `.yaml` or `.yml` file (keys
    with dashes or underscores), each as its field's type; ValueError naming the file and key
    for anything else."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"tpcore: config file {path} is a folder, not a .yaml / .json file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tpcore: config file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(
            f"tpcore: config file {path} is not UTF-8 ({e.reason} at byte {e.start})"
        ) from e
    if path.lower().endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as e:
            raise ImportError(
                "tpcore: YAML config files need PyYAML (pip install pyyaml); JSON works without it"
            ) from e
        try:
            values = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:  # its message names no file
            raise ValueError(f"tpcore: config file {path} is not valid YAML: {e}") from e
    else:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"tpcore: config file {path} is not valid JSON: {e}") from e
    if not isinstance(values, dict):
        raise ValueError(
            f"tpcore: config file {path} must hold a mapping of argument names to values"
        )
    out = {}
    for key, value in values.items():
        name = key.lstrip("-").replace("-", "_")
        if name not in fields:
            raise ValueError(f"tpcore: config file {path}: unknown argument {key!r}")
        out[name] = _coerce(fields[name], value, path)
    return out


def _coerce(field: dataclasses.Field, value, path: str):
    """A config value as its field's type (YAML reads `3e-4` as a string, for one)."""
    name, kind = field.name, str(field.type).split(" ")[0]
    if value is None and "None" in str(field.type):
        return None
    try:
        if kind == "bool" and isinstance(value, bool):
            return value
        if kind == "int" and not isinstance(value, bool) and float(value) == int(float(value)):
            return int(float(value))
        if kind == "float" and not isinstance(value, bool):
            return float(value)
        if kind == "str" and isinstance(value, str):
            return value
    except (TypeError, ValueError):
        pass
    raise ValueError(f"tpcore: config file {path}: {name} must be of type {kind}, got {value!r}")
