"""Where a model comes from: a local directory, a built-in name, or the Hugging Face Hub."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from ._lily import LilyError
from .params import LilyWarning

# Files lily reads from a checkpoint repository (weights, config, tokenizer, template).
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*"]


def cache_dir() -> Path:
    return Path(os.environ.get("LILY_CACHE", Path.home() / ".cache" / "lily"))


def builtin_models() -> dict[str, str]:
    """Names that need no download, and what they are."""
    return {
        "lily-tiny": "a small model of the same architecture trained on the Python standard library (ships with lily)",
        "synthetic:tiny": "a tiny random-weight model that lily writes itself (for smoke tests)",
    }


def lily_tiny_dir() -> Path:
    return Path(__file__).parent / "models" / "lily-tiny"


def resolve(name_or_path: str | os.PathLike, revision: str | None = None) -> Path:
    """Returns a local checkpoint directory for a path, a built-in name or a Hub repo id.

    A built-in name wins over a directory of that name in the working directory (with a
    warning): write it as a path ("./lily-tiny", or pass a Path) to load the directory.
    """
    name = str(name_or_path)
    if not name.strip():
        raise LilyError("the model path is empty; give a checkpoint directory, a built-in name "
                        f"({', '.join(builtin_models())}) or a Hub repo id")
    path = Path(name).expanduser()
    if isinstance(name_or_path, str) and name in builtin_models():
        if path.is_dir():
            warnings.warn(f"'{name}' is lily's built-in model; the directory ./{name} is not used "
                          f"(write ./{name} to load it)", LilyWarning, stacklevel=3)
        return lily_tiny_dir() if name == "lily-tiny" else _synthetic_tiny()
    if path.is_dir():
        return path
    if path.exists():
        raise LilyError(f"{path}: not a directory (pass the checkpoint directory, not a file)")
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise LilyError(f"model '{name}': no such directory, and not a Hub repo id of the form 'owner/name'")
    return _download(name, revision)


def _synthetic_tiny() -> Path:
    from . import synthetic

    out = cache_dir() / "synthetic-tiny"
    if not (out / "config.json").exists():  # config.json comes last: without it, a write was cut short
        synthetic.write_checkpoint(out, layout="mlx", seed=0, overwrite=True)
    return out


def _download(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError as e:  # pragma: no cover - a runtime dependency
        raise LilyError("huggingface_hub is needed to download models") from e
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_PATTERNS))
    except RepositoryNotFoundError as e:
        raise LilyError(f"model '{repo_id}': no such repository on the Hugging Face Hub (or it is private)") from e
    except LocalEntryNotFoundError as e:
        raise LilyError(
            f"model '{repo_id}': not in the local Hub cache and the Hub cannot be reached (offline?); "
            "download it once with network access or pass a local directory"
        ) from e
    except Exception as e:
        raise LilyError(f"model '{repo_id}': download failed ({type(e).__name__}: {e})") from e
