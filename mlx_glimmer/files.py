"""Checks on model directories and their files, shared by the target and every drafter.

Each failure is one `GlimmerError` naming the file at fault, found before a load
goes deep enough to fail with a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import GlimmerError


def check_model_dir(path: Path, what: str) -> None:
    """`path` is a directory with a config.json and model*.safetensors weights (`what`: "target", "drafter")."""
    if not path.exists():
        raise GlimmerError(f"{path}: {what} directory not found")
    if not path.is_dir():
        raise GlimmerError(f"{path}: {what} must be a directory")
    if not (path / "config.json").is_file():
        raise GlimmerError(f"{path / 'config.json'}: {what} config.json not found")
    if not list(path.glob("model*.safetensors")):
        raise GlimmerError(f"{path}: no model*.safetensors weights for the {what}")


def read_config_json(path: Path, what: str = "model") -> dict:
    """A directory's config.json as a dict."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise GlimmerError(f"{cfg_file}: {what} config.json not found")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GlimmerError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise GlimmerError(f"{cfg_file}: not a JSON object")
    return raw


def check_safetensors(path: Path) -> None:
    """A truncated safetensors file fails here with its name, not deep inside a load."""
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if path.stat().st_size < 8 + header_len + end:
            raise GlimmerError(
                f"{path}: truncated safetensors file ({path.stat().st_size} bytes, header promises {8 + header_len + end})"
            )
    except (ValueError, KeyError, UnicodeDecodeError, json.JSONDecodeError):
        raise GlimmerError(f"{path}: not a safetensors file") from None


def check_weight_files(path: Path, pattern: str = "model*.safetensors") -> None:
    """`check_safetensors` for every weight file of a model directory."""
    for f in sorted(Path(path).glob(pattern)):
        check_safetensors(f)
