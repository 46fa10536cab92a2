"""GPU check of the kernels: every Triton kernel against its reference and timed against torch.

    python -m trio_infer_kernels.check                   # every kernel (1-2 minutes on one H200)
    python -m trio_infer_kernels.check --peak-gbps 3350  # HBM peak of a GPU the table below lacks
    python -m trio_infer_kernels.check --sweep           # also time other tile configurations

This package stands alone (it imports nothing from ``trio_infer``): the end-to-end check, a
greedy generation through the engine with the Triton backend against the torch reference backend,
is ``python -m trio_infer.gpu_check``, which runs these tables first.

Without a CUDA device it prints why it has nothing to do and exits 0, so CI on CPU machines can
run it too. Exit status 1 means a correctness failure (a kernel outside its tolerance); a
performance target that is missed is printed as ``MISS`` but does not fail the run: the targets
are where tuning should get to.

What each table reports, per case:

* ``max err``: max |triton - reference| on the benchmark inputs, next to the tolerance.
* time (median of repeated runs, L2 flushed between runs, via ``triton.testing.do_bench``) of the
  Triton kernel and of the torch baseline: the reference itself for the memory-bound kernels
  (eager torch), ``scaled_dot_product_attention`` for attention (flash backend for prefill on
  contiguous K/V; for decode, SDPA on K/V gathered out of the pages beforehand, gather not timed).
* achieved GB/s (bytes the kernel must move / time) and, for attention, TFLOP/s.

Targets: decode at batch 64, context 2k at >= 70% of the HBM peak; prefill within 1.5x of SDPA's
flash attention.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import reference

NO_GPU_MESSAGE = (
    "trio_infer_kernels.check: no CUDA device, nothing to check here. The CPU engine runs the "
    "torch references; the Triton kernels are tested on CPU by `pytest tests/kernels` "
    "(interpreter)."
)

# HBM peak bandwidth (GB/s) by device name, for the "% of peak" column.
PEAK_GBPS = {"H200": 4800.0, "H100 NVL": 3900.0, "H100": 3350.0, "A100": 2039.0}

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@dataclass
class Row:
    case: str
    max_err: float
    tol: float
    triton_ms: float
    torch_ms: float | None
    bytes_moved: float
    flops: float | None = None
    target: str = ""

    @property
    def ok(self) -> bool:
        return self.max_err <= self.tol


def _bench(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _max_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).abs().max())


def _print_table(title: str, rows: list[Row], peak_gbps: float | None) -> None:
    print(f"\n== {title}")
    header = (
        f"{'case':<40} {'max err':>9} {'tol':>7} {'ok':>4} {'triton ms':>10} {'torch ms':>9} "
        f"{'speedup':>8} {'GB/s':>8} {'%peak':>6} {'TFLOP/s':>8} {'torch TF/s':>10}  target"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        gbps = r.bytes_moved / r.triton_ms / 1e6
        peak = f"{100 * gbps / peak_gbps:5.1f}%" if peak_gbps else "  n/a"
        torch_ms = f"{r.torch_ms:9.3f}" if r.torch_ms else f"{'-':>9}"
        speedup = f"{r.torch_ms / r.triton_ms:7.2f}x" if r.torch_ms else f"{'-':>8}"
        tflops = f"{r.flops / r.triton_ms / 1e9:8.1f}" if r.flops else f"{'-':>8}"
        torch_tflops = (
            f"{r.flops / r.torch_ms / 1e9:10.1f}" if r.flops and r.torch_ms else f"{'-':>10}"
        )
        print(
            f"{r.case:<40} {r.max_err:9.2e} {r.tol:7.0e} {'yes' if r.ok else 'NO':>4} "
            f"{r.triton_ms:10.3f} {torch_ms} {speedup} {gbps:8.0f} {peak:>6} {tflops} "
            f"{torch_tflops}  {r.target}"
        )


# -- memory-bound kernels -----------------------------------------------------------------------


# Benchmark shapes: Llama-3-8B / Qwen3-8B-like layers (Hq=32, Hkv=8, D=128, hidden 4096,
# intermediate 14336), a prefill-sized (4096 tokens) and a decode-sized (64 tokens) step.
STORE_KV_CASES = [(4096, 8, 128), (64, 8, 128)]  # (tokens, Hkv, D)
RMS_NORM_CASES = [(4096, 4096, False), (4096, 4096, True), (64, 4096, True)]  # (T, H, residual)
ROTARY_CASES = [(4096, 32, 8, 128), (4096, 16, 8, 64), (64, 32, 8, 128)]  # (T, Hq, Hkv, D)
SILU_CASES = [(4096, 14336), (64, 14336)]  # (tokens, intermediate)
DECODE_CASES = [  # (batch, context, Hq, Hkv, D, ragged)
    (64, 2048, 32, 8, 128, False),
    (64, 2048, 16, 16, 64, False),
    (4, 32768, 32, 8, 128, False),  # few long sequences: split-K has to fill the GPU
    (64, 4096, 32, 8, 128, True),
]
EXTEND_CASES = [  # (batch, cached, new, Hq, Hkv, D)
    (1, 0, 4096, 32, 8, 128),
    (1, 0, 4096, 32, 8, 64),
    (1, 0, 8192, 32, 8, 128),
    (4, 2048, 512, 32, 8, 128),  # chunked prefill after a cached prefix
]


def check_store_kv(dev: torch.device, cases: list = STORE_KV_CASES) -> list[Row]:
    from .store_kv import store_kv

    rows = []
    for tokens, heads, dim in cases:
        dtype, page_size = torch.bfloat16, 16
        num_pages = 2 * tokens // page_size + 1
        k = torch.randn(tokens, heads, dim, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        slots = torch.randperm(num_pages * page_size, device=dev)[:tokens]
        caches = [torch.zeros(num_pages, page_size, heads, dim, device=dev, dtype=dtype)
                  for _ in range(4)]
        store_kv(k, v, caches[0], caches[1], slots)
        reference.store_kv(k, v, caches[2], caches[3], slots)
        err = max(_max_err(caches[0], caches[2]), _max_err(caches[1], caches[3]))
        rows.append(Row(
            f"T={tokens} Hkv={heads} D={dim} bf16", err, 0.0,
            _bench(lambda: store_kv(k, v, caches[0], caches[1], slots)),
            _bench(lambda: reference.store_kv(k, v, caches[2], caches[3], slots)),
            bytes_moved=4 * k.numel() * k.element_size(),
        ))
    return rows


def check_rms_norm(dev: torch.device, cases: list = RMS_NORM_CASES) -> list[Row]:
    from .rms_norm import rms_norm

    rows = []
    for tokens, hidden, with_residual in cases:
        dtype = torch.bfloat16
        x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        w = torch.randn(hidden, device=dev, dtype=dtype)
        r = torch.randn_like(x) if with_residual else None
        out, res = rms_norm(x, w, 1e-6, r)
        out_ref, res_ref = reference.rms_norm(x, w, 1e-6, r)
        err = _max_err(out, out_ref)
        if with_residual:
            err = max(err, _max_err(res, res_ref))
        tensors = 4 if with_residual else 2
        rows.append(Row(
            f"T={tokens} H={hidden} residual={with_residual} bf16", err, TOL[dtype],
            _bench(lambda: rms_norm(x, w, 1e-6, r)),
            _bench(lambda: reference.rms_norm(x, w, 1e-6, r)),
            bytes_moved=tensors * x.numel() * x.element_size(),
        ))
    return rows


def _cos_sin_cache(max_pos: int, dim: int, dev: torch.device) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=dev, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(max_pos, device=dev, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def check_rotary(dev: torch.device, cases: list = ROTARY_CASES) -> list[Row]:
    from .rotary import rotary_embedding

    rows = []
    for tokens, hq, hkv, dim in cases:
        dtype = torch.bfloat16
        q = torch.randn(tokens, hq, dim, device=dev, dtype=dtype)
        k = torch.randn(tokens, hkv, dim, device=dev, dtype=dtype)
        pos = torch.randint(0, 8192, (tokens,), device=dev)
        cache = _cos_sin_cache(8192, dim, dev)
        got = rotary_embedding(q, k, pos, cache)
        ref = reference.rotary_embedding(q, k, pos, cache)
        err = max(_max_err(got[0], ref[0]), _max_err(got[1], ref[1]))
        moved = 2 * (q.numel() + k.numel()) * q.element_size() + tokens * dim * 4
        rows.append(Row(
            f"T={tokens} Hq={hq} Hkv={hkv} D={dim} bf16", err, TOL[dtype],
            _bench(lambda: rotary_embedding(q, k, pos, cache)),
            _bench(lambda: reference.rotary_embedding(q, k, pos, cache)),
            bytes_moved=moved,
        ))
    return rows


def check_silu_and_mul(dev: torch.device, cases: list = SILU_CASES) -> list[Row]:
    from .activation import silu_and_mul

    rows = []
    for tokens, inter in cases:
        dtype = torch.bfloat16
        x = torch.randn(tokens, 2 * inter, device=dev, dtype=dtype)
        err = _max_err(silu_and_mul(x), reference.silu_and_mul(x))
        rows.append(Row(
            f"T={tokens} I={inter} bf16", err, TOL[dtype],
            _bench(lambda: silu_and_mul(x)),
            _bench(lambda: reference.silu_and_mul(x)),
            bytes_moved=3 * tokens * inter * x.element_size(),
        ))
    return rows


# -- attention ----------------------------------------------------------------------------------


def _paged_cache(
    seq_lens: list[int], page_size: int, heads: int, dim: int, dtype: torch.dtype,
    dev: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and a page table handing each sequence pages in a random order."""
    pages_per_seq = [math.ceil(n / page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq)
    k_cache = torch.randn(num_pages, page_size, heads, dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_pages, device=dev)
    page_table = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int64, device=dev)
    start = 0
    for b, count in enumerate(pages_per_seq):
        page_table[b, :count] = order[start : start + count]
        start += count
    return k_cache, v_cache, page_table


def _gathered(cache: torch.Tensor, page_table: torch.Tensor, length: int) -> torch.Tensor:
    """Pages -> contiguous [B, H, L, D] (uniform lengths), for the SDPA baselines."""
    return reference._gather_pages(cache, page_table, length).transpose(1, 2).contiguous()


def check_decode(
    dev: torch.device, peak_gbps: float | None, cases: list = DECODE_CASES
) -> list[Row]:
    from .decode_attention import decode_attention

    rows = []
    for batch, context, hq, hkv, dim, ragged in cases:
        dtype, page_size = torch.bfloat16, 16
        gen = torch.Generator().manual_seed(batch + context)
        if ragged:
            lens = torch.randint(1, context + 1, (batch,), generator=gen).tolist()
            lens[: min(3, batch)] = [1, page_size, context][: min(3, batch)]
        else:
            lens = [context] * batch
        k_cache, v_cache, page_table = _paged_cache(lens, page_size, hkv, dim, dtype, dev)
        seq_lens = torch.tensor(lens, device=dev)
        q = torch.randn(batch, hq, dim, device=dev, dtype=dtype)
        scale = dim**-0.5
        args = (q, k_cache, v_cache, page_table, seq_lens, scale)
        err = _max_err(decode_attention(*args), reference.decode_attention(*args))
        torch_ms = None
        if not ragged:
            kd = _gathered(k_cache, page_table, context)
            vd = _gathered(v_cache, page_table, context)
            q4 = q[:, :, None, :]
            torch_ms = _bench(lambda: F.scaled_dot_product_attention(
                q4, kd, vd, scale=scale, enable_gqa=hq != hkv))
        tokens = sum(lens)
        moved = 2 * tokens * hkv * dim * 2 + 2 * q.numel() * 2
        row = Row(
            f"B={batch} L={context}{' ragged' if ragged else ''} Hq={hq} Hkv={hkv} D={dim}",
            err, TOL[dtype], _bench(lambda: decode_attention(*args)), torch_ms,
            bytes_moved=moved, flops=4.0 * tokens * hq * dim,
        )
        if (batch, context) == (64, 2048) and peak_gbps:
            share = row.bytes_moved / row.triton_ms / 1e6 / peak_gbps
            row.target = f"{'PASS' if share >= 0.7 else 'MISS'} (>=70% of HBM peak)"
        rows.append(row)
    return rows


def check_extend(dev: torch.device, cases: list = EXTEND_CASES) -> list[Row]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .extend_attention import extend_attention

    rows = []
    for batch, cached, new, hq, hkv, dim in cases:
        dtype, page_size = torch.bfloat16, 16
        seq = cached + new
        k_cache, v_cache, page_table = _paged_cache([seq] * batch, page_size, hkv, dim, dtype, dev)
        q = torch.randn(batch * new, hq, dim, device=dev, dtype=dtype)
        qsl = torch.arange(0, batch * new + 1, new, device=dev)
        seq_lens = torch.full((batch,), seq, device=dev)
        scale = dim**-0.5
        args = (q, k_cache, v_cache, page_table, qsl, seq_lens, scale)
        err = _max_err(extend_attention(*args), reference.extend_attention(*args))
        # SDPA flash on contiguous K/V, the KV heads repeated up front (not timed) so that the
        # baseline is plain multi-head flash attention.
        kd = _gathered(k_cache, page_table, seq).repeat_interleave(hq // hkv, dim=1)
        vd = _gathered(v_cache, page_table, seq).repeat_interleave(hq // hkv, dim=1)
        qd = q.view(batch, new, hq, dim).transpose(1, 2).contiguous()
        torch_ms = None
        try:
            if cached == 0:
                def sdpa() -> torch.Tensor:
                    return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
            else:
                from torch.nn.attention.bias import causal_lower_right

                bias = causal_lower_right(new, seq)

                def sdpa() -> torch.Tensor:
                    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=bias, scale=scale)

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                torch_ms = _bench(sdpa)
        except RuntimeError as exc:  # no flash kernel for this shape: report the Triton side only
            print(f"  (SDPA flash baseline unavailable for {batch}x{cached}+{new}: {exc})")
        visible = batch * sum(cached + i + 1 for i in range(new))
        row = Row(
            f"B={batch} cached={cached} new={new} Hq={hq} Hkv={hkv} D={dim}", err, TOL[dtype],
            _bench(lambda: extend_attention(*args)), torch_ms,
            bytes_moved=(q.numel() * 2 + 2 * batch * seq * hkv * dim) * 2,
            flops=4.0 * visible * hq * dim,
        )
        if torch_ms:
            ratio = row.triton_ms / torch_ms
            row.target = f"{'PASS' if ratio <= 1.5 else 'MISS'} ({ratio:.2f}x SDPA flash, <=1.5x)"
        rows.append(row)
    return rows


# -- tuning sweep -------------------------------------------------------------------------------

# Candidate launch configurations, a short list around the defaults (each costs a compile).
DECODE_SWEEP = [  # (block_n, num_warps, num_stages, num_splits or None for the heuristic)
    (64, 4, 2, None), (32, 4, 2, None), (128, 4, 2, None), (64, 8, 2, None), (64, 4, 3, None),
    (64, 2, 2, None), (64, 4, 2, 1), (64, 4, 2, 2), (64, 4, 2, 4), (64, 4, 2, 8),
]
EXTEND_SWEEP = [  # (block_m, block_n, num_warps, num_stages)
    (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 2), (128, 128, 8, 2), (128, 32, 4, 3),
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2),
]


def sweep(
    dev: torch.device, decode_case: tuple = DECODE_CASES[0], extend_case: tuple = EXTEND_CASES[0]
) -> None:
    """Time alternative tile configurations on the headline shapes and print them, fastest
    first, so one GPU session yields the data to retune the defaults in the kernel modules."""
    from .decode_attention import decode_attention
    from .extend_attention import extend_attention

    dtype, page_size = torch.bfloat16, 16
    batch, context, hq, hkv, dim = decode_case[:5]
    k_cache, v_cache, page_table = _paged_cache([context] * batch, page_size, hkv, dim, dtype, dev)
    q = torch.randn(batch, hq, dim, device=dev, dtype=dtype)
    seq_lens = torch.full((batch,), context, device=dev)
    args = (q, k_cache, v_cache, page_table, seq_lens, dim**-0.5)
    moved = 2 * batch * context * hkv * dim * 2
    timings = []
    for block_n, warps, stages, splits in DECODE_SWEEP:
        ms = _bench(lambda: decode_attention(*args, block_n=block_n, num_warps=warps,
                                             num_stages=stages, num_splits=splits))
        timings.append((ms, f"block_n={block_n} warps={warps} stages={stages} splits={splits}"))
    print(f"\n== sweep: decode B={batch} L={context} Hq={hq} Hkv={hkv} D={dim}")
    for ms, cfg in sorted(timings):
        print(f"{cfg:<50} {ms:8.3f} ms {moved / ms / 1e6:8.0f} GB/s")

    _, _, new, hq, hkv, dim = extend_case  # a fresh prompt: batch 1, nothing cached
    k_cache, v_cache, page_table = _paged_cache([new], page_size, hkv, dim, dtype, dev)
    q = torch.randn(new, hq, dim, device=dev, dtype=dtype)
    qsl = torch.tensor([0, new], device=dev)
    seq_lens = torch.tensor([new], device=dev)
    args = (q, k_cache, v_cache, page_table, qsl, seq_lens, dim**-0.5)
    flops = 4.0 * sum(i + 1 for i in range(new)) * hq * dim
    timings = []
    for block_m, block_n, warps, stages in EXTEND_SWEEP:
        ms = _bench(lambda: extend_attention(*args, block_m=block_m, block_n=block_n,
                                             num_warps=warps, num_stages=stages))
        timings.append((ms, f"block_m={block_m} block_n={block_n} warps={warps} stages={stages}"))
    print(f"\n== sweep: prefill T={new} Hq={hq} Hkv={hkv} D={dim}")
    for ms, cfg in sorted(timings):
        print(f"{cfg:<50} {ms:8.3f} ms {flops / ms / 1e9:8.1f} TFLOP/s")


def cuda_device(prog: str, no_gpu_message: str = NO_GPU_MESSAGE) -> torch.device | None:
    """The CUDA device to check, or None (after printing ``no_gpu_message``) when there is none.
    Raises SystemExit(1) when CUDA is there but Triton does not import: a CUDA machine must have
    a working Triton for the GPU engine."""
    if not torch.cuda.is_available():
        print(no_gpu_message)
        return None
    try:
        import triton  # noqa: F401
    except Exception as exc:
        print(f"{prog}: CUDA is available but Triton does not import: {exc!r}")
        raise SystemExit(1) from None
    return torch.device("cuda")


def check_kernels(dev: torch.device, peak_gbps: float | None = None, sweep_too: bool = False) -> bool:
    """Print every kernel's table (and the sweep); True when every kernel is within tolerance."""
    import triton

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    peak = peak_gbps or next((v for k, v in PEAK_GBPS.items() if k in name), None)
    print(f"device: {name}; triton {triton.__version__}; torch {torch.__version__}; "
          f"HBM peak {f'{peak:.0f} GB/s' if peak else 'unknown (pass --peak-gbps)'}")
    torch.manual_seed(0)
    all_ok = True
    sections: list[tuple[str, Callable[[], list[Row]]]] = [
        ("store_kv", lambda: check_store_kv(dev)),
        ("rms_norm", lambda: check_rms_norm(dev)),
        ("rotary_embedding", lambda: check_rotary(dev)),
        ("silu_and_mul", lambda: check_silu_and_mul(dev)),
        ("decode_attention (paged, split-K)", lambda: check_decode(dev, peak)),
        ("extend_attention (paged prefill, causal)", lambda: check_extend(dev)),
    ]
    for title, run in sections:
        rows = run()
        _print_table(title, rows, peak)
        all_ok &= all(r.ok for r in rows)
    if sweep_too:
        sweep(dev)
    return all_ok


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peak-gbps", type=float, help="HBM peak of this GPU, GB/s")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trio_infer_kernels.check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    dev = cuda_device("trio_infer_kernels.check")
    if dev is None:
        return 0
    start = time.perf_counter()
    all_ok = check_kernels(dev, args.peak_gbps, args.sweep)
    print(f"\n{'all correct' if all_ok else 'CORRECTNESS FAILURES above'}; "
          f"{time.perf_counter() - start:.0f}s")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
