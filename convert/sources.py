"""Where a checkpoint comes from: a local directory, a `.gguf` file, or a Hugging Face repo id."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.files import check_model_files, check_regular_file

# What a conversion needs from a hub repo: weights, configs, tokenizer and chat template.
HUB_PATTERNS = [
    "*.safetensors",
    "*.json",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Source:
    spec: str  # a repo id, or the absolute local path; recorded in glimmer.json
    path: Path  # a model directory, or a .gguf file
    kind: str  # "dir" | "gguf"


def resolve(spec: str, what: str) -> Source:
    path = Path(spec).expanduser()
    if path.exists():
        path = path.resolve()
        if path.is_dir():
            check_model_files(path, what)  # a FIFO where a weight or config file is expected: named, not waited on
            return Source(str(path), path, "dir")
        if path.suffix.lower() == ".gguf":
            check_regular_file(path, f"{what} .gguf file")
            return Source(str(path), path, "gguf")
        raise GlimmerError(f"{path}: {what} must be a model directory or a .gguf file")
    if path.suffix.lower() == ".gguf" or not REPO_ID.match(spec):
        raise GlimmerError(f"{spec}: no such {what} directory or file")
    downloaded = download(spec, what)
    check_model_files(downloaded, what)
    return Source(spec, downloaded, "dir")


def download(repo_id: str, what: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo, network down: all the user's to fix
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GlimmerError(f"{repo_id}: cannot download the {what} from the Hugging Face Hub ({reason})") from None
