"""The whole GPU check: the kernels' tables, then end to end through the engine.

    python -m trio_infer.gpu_check             # everything (a few minutes at most on one H200)
    python -m trio_infer.gpu_check --skip-e2e  # the kernels only (= trio_infer_kernels.check)
    python -m trio_infer.gpu_check --sweep     # also time other tile configurations
    python -m trio_infer.gpu_check --peak-gbps 3350

The kernel-level part is ``kernels/check.py`` (``python -m trio_infer_kernels.check``; the
``kernels/`` package imports nothing from ``trio_infer``). This module adds what needs the engine
and the models: a greedy generation on a random "small" Qwen3 checkpoint (``models/synthetic.py``)
through :class:`~trio_infer.engine.engine.Engine`, with the Triton backend and with the torch
reference backend (``trio_infer_kernels.ops.forced_reference``). fp32 must agree token for token
(both backends compute in fp32; only summation order differs); bf16 agreement is reported (rounding
may flip a near-tie late in a sequence).

Without a CUDA device it prints why it has nothing to do and exits 0. Exit status 1 means a
correctness failure: a kernel outside its tolerance, or the fp32 generations differing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from trio_infer_kernels import check, ops
from trio_infer.engine.engine import Engine, EngineConfig
from trio_infer.wire import SamplingParams
from trio_infer.models.loader import load_model
from trio_infer.models.synthetic import SHAPES, build_random_checkpoint

NO_GPU_MESSAGE = (
    "trio_infer.gpu_check: no CUDA device, nothing to check here. The CPU engine runs the torch "
    "references and the C kernels; `pytest tests/kernels` tests the Triton kernels on the CPU "
    "(interpreter)."
)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def check_end_to_end(dev: torch.device, shape: str = "small", num_prompts: int = 24) -> bool:
    """Greedy generation on a random ``shape`` checkpoint, Triton backend vs torch reference;
    True when the fp32 runs agree token for token."""
    print("\n== end to end: greedy generation, Triton backend vs torch reference backend")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 400, (num_prompts,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # Every prompt admitted at once, whole prompts per step: the batch shapes a GPU serves.
    config = EngineConfig(page_size=16, num_pages=2048, max_running=64, max_batched_tokens=2048)

    def generate(model: object) -> tuple[list[list[int]], float]:
        engine = Engine(model, config, device=str(dev))  # type: ignore[arg-type]
        for uid, prompt in enumerate(prompts):
            engine.add_request(uid, prompt, params)
        out: list[list[int]] = [[] for _ in prompts]
        _sync(dev)
        start = time.perf_counter()
        while engine.has_unfinished():
            for o in engine.step():
                out[o.uid].extend(o.token_ids)  # type: ignore[index]
        _sync(dev)
        return out, time.perf_counter() - start

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = build_random_checkpoint(tmp, "Qwen3ForCausalLM", **SHAPES[shape])
        print(f"built a random {shape!r} Qwen3 checkpoint in {time.perf_counter() - t0:.1f}s")
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(path, dtype=dtype, device=dev)
            triton_out, triton_s = generate(model)
            with ops.forced_reference():
                ref_out, ref_s = generate(model)
            same = sum(a == b for a, b in zip(triton_out, ref_out))
            prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                      for a, b in zip(triton_out, ref_out)]
            tokens = sum(len(o) for o in triton_out)
            verdict = "yes" if same == len(prompts) else ("NO" if dtype == torch.float32 else "~")
            print(
                f"{str(dtype):<15} identical sequences {same}/{len(prompts)} {verdict:>3}  "
                f"min common prefix {min(prefix)}/{params.max_tokens}  "
                f"triton {tokens / triton_s:8.0f} tok/s  reference {tokens / ref_s:8.0f} tok/s"
            )
            if dtype == torch.float32 and same != len(prompts):
                ok = False
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trio_infer.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_arguments(parser)
    parser.add_argument("--skip-e2e", action="store_true", help="kernels only")
    args = parser.parse_args(argv)
    dev = check.cuda_device("trio_infer.gpu_check", NO_GPU_MESSAGE)
    if dev is None:
        return 0
    start = time.perf_counter()
    all_ok = check.check_kernels(dev, args.peak_gbps, args.sweep)
    if not args.skip_e2e:
        all_ok &= check_end_to_end(dev)
    print(f"\n{'all correct' if all_ok else 'CORRECTNESS FAILURES above'}; "
          f"{time.perf_counter() - start:.0f}s")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
