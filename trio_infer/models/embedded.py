"""The model the server runs when it is given none: tiny, random, built locally in seconds.

It lets ``hypercorn trio_infer.app:app`` start and answer on a machine with no network and no
download, and gives every layer above the model a real checkpoint to exercise (tokenizer, chat
template, safetensors, paged attention). Its text is nonsense; its behaviour is fully real.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from trio_infer.models.synthetic import SHAPES, build_random_checkpoint

DEFAULT_MODEL_NAME = "trio-infer-tiny"
DEFAULT_MODEL_DIRNAME = "default-model"
# A checkpoint folder may hold this one-line file naming the id it is served under by default;
# the loader reads it. The default model uses it so it is served as DEFAULT_MODEL_NAME rather than
# under its folder's name.
SERVED_NAME_FILE = "served_name"


def ensure_default_model(cache_dir: Path) -> Path:
    """Return ``cache_dir / "default-model"``, building it first if it is not there yet.

    The build happens in a temporary folder next to the target and is renamed into place, so a
    crash mid-build never leaves a half-written checkpoint that later runs would trust, and two
    processes racing to build it both end up with one complete copy.
    """
    target = Path(cache_dir) / DEFAULT_MODEL_DIRNAME
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_DIRNAME}-", dir=target.parent))
    try:
        build_random_checkpoint(staging, "Qwen3ForCausalLM", seed=0, **SHAPES["tiny"])
        (staging / SERVED_NAME_FILE).write_text(DEFAULT_MODEL_NAME + "\n")
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
