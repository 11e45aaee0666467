"""Checks on model directories and their files, shared by the target and every drafter.

Each failure is one `GlimmerError` naming the file at fault, found before a load
goes deep enough to fail with a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import GlimmerError


@contextmanager
def looking_into(directory: Path, what: str = "this") -> Iterator[None]:
    """An OS error while looking into `directory` (one the user may not read) is one error naming it."""
    try:
        yield
    except OSError as e:
        raise GlimmerError(f"{directory}: cannot read {what} directory ({e.strerror or e})") from None


# The files a load reads from a model directory: weights, configs, tokenizer, chat template.
MODEL_FILE_PATTERNS = ("*.safetensors", "*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.gguf")

_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def check_regular_file(path: Path, what: str = "file") -> None:
    """`path`, where it exists, is a regular file (a link to one is fine): the one check before any weight,
    config or tokenizer file is opened. Anything else is one error naming it, at once: opening a FIFO waits for
    a writer forever, a device never ends, a directory fails deep inside a reader. A path that is not there at
    all is left to the caller (which says what is missing); a link to nothing is an error here."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            raise GlimmerError(f"{path}: {what} is a symbolic link to nothing ({os.readlink(path)})") from None
        return
    except OSError as e:
        raise GlimmerError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
        raise GlimmerError(f"{path}: the {what} is {kind}, not a regular file")


def check_model_files(path: Path, what: str = "model") -> None:
    """`check_regular_file` for every file of directory `path` that a load would read (`MODEL_FILE_PATTERNS`)."""
    with looking_into(path, f"the {what}"):
        names = sorted(os.listdir(path))
    for name in names:
        if any(Path(name).match(pattern) for pattern in MODEL_FILE_PATTERNS):
            check_regular_file(Path(path) / name, f"{what} file")


def check_model_dir(path: Path, what: str) -> None:
    """`path` is a directory with a config.json and model*.safetensors weights (`what`: "target", "drafter"),
    every file a load reads a regular one (`check_model_files`)."""
    with looking_into(path, f"the {what}"):
        if not path.exists():
            raise GlimmerError(f"{path}: {what} directory not found")
        if not path.is_dir():
            raise GlimmerError(f"{path}: {what} must be a directory")
        os.listdir(path)  # a listing it may not read would look like a directory without weights
    check_model_files(path, what)
    with looking_into(path, f"the {what}"):
        if not (path / "config.json").is_file():
            raise GlimmerError(f"{path / 'config.json'}: {what} config.json not found")
        if not list(path.glob("model*.safetensors")):
            raise GlimmerError(f"{path}: no model*.safetensors weights for the {what}")


def read_config_json(path: Path, what: str = "model") -> dict:
    """A directory's config.json as a dict."""
    cfg_file = Path(path) / "config.json"
    check_regular_file(cfg_file, f"{what} config")
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
    check_regular_file(path, "weights file")
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


# ---- bundles ------------------------------------------------------------------------------------------

BUNDLE_FORMAT = "mlx-glimmer/1"


def read_bundle_manifest(path: Path) -> dict[str, Any]:
    """BUNDLE/glimmer.json, checked: a JSON object of our format naming its target (and drafter) directory."""
    manifest_path = Path(path) / "glimmer.json"
    check_regular_file(manifest_path, "bundle manifest")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GlimmerError(f"{manifest_path}: not valid JSON ({e})") from None
    except OSError as e:
        raise GlimmerError(f"{manifest_path}: cannot read it ({e.strerror or e})") from None
    if not isinstance(manifest, dict):
        raise GlimmerError(f"{manifest_path}: not a JSON object (got {type(manifest).__name__})")
    if manifest.get("format") != BUNDLE_FORMAT:
        raise GlimmerError(f"{manifest_path}: format {manifest.get('format')!r}, expected {BUNDLE_FORMAT!r}")
    if not isinstance(manifest.get("target"), str) or not manifest["target"]:
        raise GlimmerError(f"{manifest_path}: field 'target' must name the target directory")
    if manifest.get("drafter") is not None and not isinstance(manifest["drafter"], str):
        raise GlimmerError(f"{manifest_path}: field 'drafter' must name the drafter directory, or be null")
    return manifest


@dataclass
class PairPaths:
    target: Path
    drafter: Path | None
    bundle: bool  # the target is a mlx-glimmer bundle's


def pair_paths(path, target, drafter, use_drafter: bool = True) -> PairPaths:
    """Where the target and drafter of `load(path, target=, drafter=)` are (both backends)."""
    bundle = False
    if path is not None:
        path = Path(path)
        with looking_into(path):
            if not path.exists():
                raise GlimmerError(f"{path}: no such bundle or directory")
            bundle = (path / "glimmer.json").is_file()
            if not bundle and os.path.lexists(path / "glimmer.json"):
                check_regular_file(path / "glimmer.json", "bundle manifest")  # a FIFO, a device: named here
        target_path = path
        if bundle:
            manifest = read_bundle_manifest(path)
            target_path = path / manifest["target"]
            if drafter is None and manifest.get("drafter"):
                drafter = path / manifest["drafter"]
    elif target is not None:
        target_path = Path(target)
    else:
        raise GlimmerError("no model given: pass a bundle path or target=DIR")
    return PairPaths(target_path, Path(drafter) if drafter is not None and use_drafter else None, bundle)


def check_pair_dirs(path, drafter=None, use_drafter: bool = True) -> PairPaths:
    """`pair_paths` and a look at both directories (config.json, weights present): what a command checks
    before it loads anything, so a bad path is one error line at once."""
    paths = pair_paths(path, None, drafter, use_drafter)
    check_model_dir(paths.target, "target")
    if paths.drafter is not None:
        check_model_dir(paths.drafter, "drafter")
    return paths


@contextmanager
def staged_directory(out: Path, what: str) -> Iterator[Path]:
    """A private directory beside `out` to write `what` into: put at `out` (`publish_directory`) when the block
    ends, removed when it raises, so `out` is never half written."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as e:
        raise GlimmerError(f"{out.parent}: cannot create the {what} there ({e.strerror or e})") from None
    try:
        yield staging
        publish_directory(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_whole(path: Path, text: str) -> None:
    """`text` at `path`, written whole or not at all (a kill leaves the file as it was)."""
    tmp = path.with_suffix(".partial")
    tmp.write_text(text)
    tmp.rename(path)


def published_directory(out: Path) -> Path:
    """`out`, or, when a kill fell between `publish_directory`'s two renames (`out` then missing), the whole
    directory it had moved aside."""
    if out.exists() or out.is_symlink():
        return out
    aside = sorted(out.parent.glob(f".{out.name}.*.old"), key=lambda p: p.stat().st_mtime)
    return aside[-1] if aside else out


def remove_leftovers(out: Path) -> None:
    """Remove what killed `staged_directory` blocks left beside `out` (staging directories, a moved-aside copy):
    only for a writer that knows no other process writes `out`."""
    for left in [*out.parent.glob(f".{out.name}.*.partial"), *out.parent.glob(f".{out.name}.*.old")]:
        shutil.rmtree(left, ignore_errors=True)


def publish_directory(staging: Path, out: Path) -> None:
    """Put the finished directory `staging` (made private by `tempfile.mkdtemp`) at `out` with the permissions a
    new directory gets, replacing what is there: the old one is moved aside first and put back if the rename
    fails, so `out` is never half written."""
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    if not (out.exists() or out.is_symlink()):
        staging.rename(out)
        return
    old = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.old"
    out.rename(old)
    try:
        staging.rename(out)
    except BaseException:
        old.rename(out)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()
