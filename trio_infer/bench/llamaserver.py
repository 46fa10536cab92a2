"""llama.cpp's own HTTP server (``llama-server``) as a bench baseline, built once and cached.

The binary is built from the llama.cpp that the llama-cpp-python sdist vendors
(``vendor/llama.cpp``), the same llama.cpp as the ``llama.cpp`` baseline of ``offline``, so the
two baselines agree. Only the ``llama-server`` target is built (no tests, examples or other
tools), Release, ``-DGGML_NATIVE=ON`` (this machine's instruction set, less AMX: see
:data:`CMAKE_FLAGS`), static libraries, no web UI download, no OpenSSL, with ninja. Everything lives under the cache
(``~/.cache/trio-infer/llama-server/<version>/``):

- ``llama_cpp_python-<version>.tar.gz``: the sdist (``pip download --no-deps --no-binary :all:``,
  the only network access, once);
- ``src/``: its ``vendor/llama.cpp``; ``build/``: the ninja tree; ``build.log``;
- ``bin/llama-server``: the binary the bench runs, and ``bin/build-flags``, the flags it was
  built with (a binary built with other flags is built again).

``python -m trio_infer.bench llama-server --build`` builds it (about 10 minutes on 2 cores) and
prints its path; the benches that need it build it on first use, saying so. Tests never build it:
they skip when :func:`find_binary` finds nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python's, whose vendored llama.cpp is built
ENV_BINARY = "TRIO_INFER_LLAMA_SERVER"  # an existing binary to use instead of the cached one

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TOOLS=ON",  # the server is one of the tools; only its target is built
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else it downloads the web UI at build time
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    # This llama.cpp's AMX matrix product (x86 CPUs with AMX-INT8: Sapphire Rapids and later)
    # crashes the server on its first forward, at load (a segfault in ggml_backend_amx_mul_mat;
    # llama.cpp issue 20824, closed without a fix). GGML_NATIVE's -march=native turns it on
    # wherever the CPU has AMX; the explicit -mno- flags win over -march's, so AMX is left out
    # and everything else of the native build stays (AVX-512, VNNI, the CPU repacks). No effect
    # on a CPU without AMX.
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
)
# Written next to the binary: a binary built with other flags is built again.
_FLAGS_STAMP = "\n".join(CMAKE_FLAGS) + "\n"


class BuildError(RuntimeError):
    """The binary could not be built; the message says why and what to do."""


def cache_root(cache_dir: Path | None = None, version: str = VERSION) -> Path:
    if cache_dir is None:
        from trio_infer.models.default_model import default_cache_dir

        cache_dir = default_cache_dir()
    return Path(cache_dir) / "llama-server" / version


def binary_path(cache_dir: Path | None = None, version: str = VERSION) -> Path:
    return cache_root(cache_dir, version) / "bin" / "llama-server"


def find_binary(cache_dir: Path | None = None) -> Path | None:
    """``$TRIO_INFER_LLAMA_SERVER`` if set, else the cached build; None if there is none."""
    env = os.environ.get(ENV_BINARY)
    if env:
        path = Path(env).expanduser()
        return path if path.is_file() and os.access(path, os.X_OK) else None
    path = binary_path(cache_dir)
    return path if _is_current(path) else None


def _is_current(path: Path) -> bool:
    """The cached binary exists and was built with today's :data:`CMAKE_FLAGS`."""
    stamp = path.with_name("build-flags")
    return path.is_file() and os.access(path, os.X_OK) and stamp.is_file() \
        and stamp.read_text() == _FLAGS_STAMP


def missing_tools() -> list[str]:
    """What the build needs and this machine lacks (cmake, ninja, a C and a C++ compiler)."""
    missing = [tool for tool in ("cmake", "ninja") if shutil.which(tool) is None]
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        missing.append("a C compiler (cc/gcc/clang)")
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
            or shutil.which("clang++")):
        missing.append("a C++ compiler (c++/g++/clang++)")
    return missing


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fetch_sdist(root: Path, version: str = VERSION) -> Path:
    """The llama-cpp-python sdist in ``root``, downloaded with pip the first time."""
    name = f"llama_cpp_python-{version}.tar.gz"
    sdist = root / name
    if sdist.is_file():
        return sdist
    root.mkdir(parents=True, exist_ok=True)
    _say(f"llama-server: downloading the llama-cpp-python {version} sdist (~75 MB) with pip ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={version}", "-d", str(root)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not sdist.is_file():
        raise BuildError(
            f"could not download the llama-cpp-python {version} sdist ({' '.join(cmd)}):\n"
            f"{(proc.stdout + proc.stderr)[-2000:]}\nPut {name} in {root} by hand, or point "
            f"${ENV_BINARY} at a llama-server binary."
        )
    return sdist


def extract_vendored(sdist: Path, dest: Path, version: str = VERSION) -> Path:
    """``vendor/llama.cpp`` of the sdist, as ``dest`` (extracted once)."""
    if (dest / "CMakeLists.txt").is_file() and (dest / "tools" / "server").is_dir():
        return dest
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(prefix) or m.name == prefix:
                continue
            m.name = m.name[len(prefix):]
            members.append(m)
        if not members:
            raise BuildError(f"{sdist} holds no {prefix}")
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def build(cache_dir: Path | None = None, version: str = VERSION, jobs: int | None = None) -> Path:
    """Build ``llama-server`` into the cache (if it is not there yet) and return its path."""
    root = cache_root(cache_dir, version)
    out = root / "bin" / "llama-server"
    if _is_current(out):
        return out
    missing = missing_tools()
    if missing:
        raise BuildError(
            "building llama-server needs " + ", ".join(missing) + " on the PATH (e.g. "
            "`apt-get install cmake ninja-build g++`), or point $" + ENV_BINARY + " at a "
            "llama-server binary."
        )
    sdist = fetch_sdist(root, version)
    src = extract_vendored(sdist, root / "src", version)
    build_dir = root / "build"
    log_path = root / "build.log"
    jobs = jobs or os.cpu_count() or 1
    _say(f"llama-server: building it once from the llama.cpp vendored in llama-cpp-python "
         f"{version} (only the llama-server target, Release, GGML_NATIVE=ON, ninja -j{jobs}); "
         f"this takes about 10 minutes on 2 quiet cores, much longer on busy ones. "
         f"Log: {log_path}")
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        for step in (
            ["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja", *CMAKE_FLAGS],
            ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
        ):
            log.write(("\n$ " + " ".join(step) + "\n").encode())
            log.flush()
            proc = subprocess.run(step, stdout=log, stderr=subprocess.STDOUT)
            if proc.returncode != 0:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise BuildError(f"`{' '.join(step)}` failed (exit {proc.returncode}); the end "
                                 f"of {log_path}:\n{tail}")
    built = build_dir / "bin" / "llama-server"
    if not built.is_file():
        raise BuildError(f"the build finished but {built} is not there; see {log_path}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.copy2(built, tmp)
    tmp.rename(out)  # atomic: a half-copied binary is never found
    out.with_name("build-flags").write_text(_FLAGS_STAMP)
    _say(f"llama-server: built in {time.monotonic() - t0:.0f} s: {out}")
    return out


def require(cache_dir: Path | None = None, *, build_if_missing: bool = True) -> Path:
    """The binary: found, else built (a clear ``SystemExit`` when that cannot be done)."""
    found = find_binary(cache_dir)
    if found is not None:
        return found
    if os.environ.get(ENV_BINARY):
        raise SystemExit(f"error: ${ENV_BINARY}={os.environ[ENV_BINARY]} is not an executable file")
    if not build_if_missing:
        raise SystemExit(f"error: no llama-server at {binary_path(cache_dir)}; build it with "
                         "`python -m trio_infer.bench llama-server --build`")
    try:
        return build(cache_dir)
    except BuildError as exc:
        raise SystemExit(f"error: {exc}") from None


def command(binary: Path, model: Path, port: int | str, *, threads: int = 2, slots: int = 1,
            ctx_per_slot: int | None = None, extra: list[str] | None = None) -> list[str]:
    """llama-server on ``model``: ``threads`` threads for generation and prompts, ``slots``
    parallel sequences, each with ``ctx_per_slot`` tokens of context (None: llama-server's
    default context, the model's training length, shared by the slots)."""
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(slots)]
    if ctx_per_slot:
        cmd += ["-c", str(slots * ctx_per_slot)]
    return cmd + list(extra or [])


# -- python -m trio_infer.bench llama-server ------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--build", action="store_true",
                   help="build the binary if it is not cached yet (about 10 minutes on 2 cores)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="default: the server's cache_dir (~/.cache/trio-infer)")


def main(args: argparse.Namespace) -> int:
    found = find_binary(args.cache_dir)
    if found is None and args.build:
        found = require(args.cache_dir)
    if found is None:
        print(f"not built: {binary_path(args.cache_dir)} (run with --build)", file=sys.stderr)
        return 1
    print(found)
    return 0
