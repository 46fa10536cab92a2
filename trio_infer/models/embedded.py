"""The tiny random model, served as ``trio-infer-tiny``: built locally in seconds, no download.

``--model trio-infer-tiny`` (or ``TRIO_INFER_MODEL=trio-infer-tiny``) serves it. Its text is
nonsense, but its behaviour is fully real (tokenizer, chat template, safetensors, paged attention)
and a step takes milliseconds on a CPU, so tests and benchmarks that only need *a* model use it.
The model served when none is configured is a real one (see
:mod:`trio_infer.models.default_model`).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

# The id it is served under. This module imports nothing heavy at import time (torch comes with
# the build), so models/paths.py, torch-free, resolves the name through it.
TINY_MODEL_NAME = "trio-infer-tiny"
TINY_MODEL_DIRNAME = "tiny-model"
# A checkpoint folder may hold this one-line file naming the id it is served under by default;
# the loader reads it. The tiny model uses it so it is served as TINY_MODEL_NAME rather than
# under its folder's name.
SERVED_NAME_FILE = "served_name"


def ensure_tiny_model(cache_dir: Path) -> Path:
    """Return ``cache_dir / "tiny-model"``, building it first if it is not there yet.

    The build happens in a temporary folder next to the target and is renamed into place, so a
    crash mid-build never leaves a half-written checkpoint that later runs would trust, and two
    processes racing to build it both end up with one complete copy.
    """
    target = Path(cache_dir) / TINY_MODEL_DIRNAME
    if target.is_dir():
        return target
    # Imported only to build it: synthetic.py imports transformers' model code (a second and
    # more), which the model loader, importing this module for SERVED_NAME_FILE, never needs.
    from trio_infer.models.synthetic import SHAPES, build_random_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_DIRNAME}-", dir=target.parent))
    try:
        build_random_checkpoint(staging, "Qwen3ForCausalLM", seed=0, **SHAPES["tiny"])
        (staging / SERVED_NAME_FILE).write_text(TINY_MODEL_NAME + "\n")
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
