"""Random-weight checkpoints of a named shape, built once into a cache folder and reused.

They are ordinary Hugging Face folders written by
:func:`trio_infer.models.synthetic.build_random_checkpoint`, so our engine loads them through the
normal :func:`~trio_infer.models.loader.load_model` path and transformers (the baselines) through
``from_pretrained``: both run the very same weights.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

DEFAULT_CACHE = Path.home() / ".cache" / "trio-infer" / "bench"


def shape_names() -> list[str]:
    from trio_infer.models.synthetic import SHAPES

    return list(SHAPES)


def ensure_shape_checkpoint(shape: str, cache_dir: Path | None = None, seed: int = 0) -> Path:
    """``cache_dir/<shape>-seed<seed>``, built first (fp32, Qwen3) if it is not there yet.

    The build goes to a staging folder renamed into place, so an interrupted build is never
    mistaken for a complete one.
    """
    from trio_infer.models.synthetic import SHAPES, build_random_checkpoint

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cache_dir = Path(cache_dir or DEFAULT_CACHE)
    target = cache_dir / f"{shape}-seed{seed}"
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"building a random {shape} checkpoint in {target} (once) ...", flush=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=cache_dir))
    try:
        build_random_checkpoint(staging, "Qwen3ForCausalLM", seed=seed, **SHAPES[shape])
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
