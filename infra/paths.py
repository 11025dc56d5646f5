"""Where Tandem's files are: the repository, the bundled model, the cache of the random tiny model."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUNDLED_MODEL = REPO / "checkpoints" / "tandem-code-mini"
TINY_CACHE = Path.home() / ".cache" / "tandem" / "tiny"


def default_model_dir() -> Path:
    """The bundled trained model when present, else the random tiny model's directory (which `tandem serve`,
    `tandem target` and `tandem draft` make once; the gateway only reads it)."""
    return BUNDLED_MODEL if (BUNDLED_MODEL / "config.json").exists() else TINY_CACHE
