"""``--tensor-parallel N``: the shard plan, the settings it is refused with, greedy parity of a
group of real rank processes against one worker (tiny Llama, Qwen2, Qwen3 checkpoints and the
default SmolLM2 GGUF), a group over two "nodes" joined by a TCP rendezvous, and a follower rank
killed under load through a real ``serve``.

Tolerance: an all-reduce adds a row-parallel layer's partial sums in a different order than one
matmul does, so logits may differ in the last bits of fp32. The parity tests ask for the same
greedy ids on every prompt, and for each sampled token's logprob within ``LOGPROB_TOL``, with a
float32 KV cache (measured: at most 1.1e-5). With the float16 KV cache (the CPU default) such a
last-bit difference sometimes rounds a cached key or value to the neighbouring half, which moved
logprobs by up to 1.2e-3 in one measurement (greedy ids still equal); that is the KV dtype's
tolerance (docs/kernels.md), not the group's, so the tests pin float32.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trio
from hypothesis import given, settings as hsettings, strategies as st
from pydantic import ValidationError

from trio_infer.models.default_model import default_cache_dir, default_model_file
from trio_infer.models.parallel import ShardError, ShardPlan, split_even
from trio_infer.models.llama import LlamaSpec
from trio_infer.runtime.in_process import in_process as serve_in_process
from trio_infer.runtime.client import open_engine
from trio_infer.settings import Settings
from trio_infer.wire import SamplingParams

LOGPROB_TOL = 1e-4
SMOLLM2 = default_model_file(default_cache_dir())
MAX_TOKENS = 12
# Lengths around the page size (16): a decode-only batch, prefills of one and several pages.
PROMPT_LENGTHS = (3, 16, 37, 9)


def spec(**kw) -> LlamaSpec:  # type: ignore[no-untyped-def]
    base = dict(architecture="LlamaForCausalLM", hidden_size=64, num_layers=2, num_heads=9,
                num_kv_heads=3, head_dim=16, intermediate_size=96, vocab_size=1001,
                max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
                qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
    return LlamaSpec(**{**base, **kw})


# -- the shard plan -------------------------------------------------------------------------------


@given(total_units=st.integers(1, 200), parts=st.integers(1, 8), unit=st.sampled_from([1, 32]))
def test_split_even_covers_the_range_in_whole_units(total_units, parts, unit) -> None:
    ranges = split_even(total_units * unit, parts, unit)
    assert len(ranges) == parts
    assert ranges[0][0] == 0 and ranges[-1][1] == total_units * unit
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [stop - start for start, stop in ranges]
    assert all(s % unit == 0 for s in sizes) and max(sizes) - min(sizes) <= unit


@hsettings(max_examples=30, deadline=None)
@given(kv=st.integers(1, 4), group=st.integers(1, 3), size=st.integers(1, 4),
       vocab=st.integers(8, 40), inter=st.integers(4, 20), data=st.data())
def test_every_rank_slice_put_back_together_is_the_checkpoint(kv, group, size, vocab, inter,
                                                             data) -> None:
    """take() over all ranks: row slices concatenate to the tensor, column slices too, and a
    row-parallel bias is whole on rank 0 and zero elsewhere (so the all-reduce adds it once)."""
    s = spec(num_heads=kv * group, num_kv_heads=kv, head_dim=2, intermediate_size=inter,
             vocab_size=vocab, hidden_size=6)
    if size > kv:
        with pytest.raises(ShardError, match="kv heads"):
            ShardPlan.build(s, 0, size)
        return
    plans = [ShardPlan.build(s, r, size) for r in range(size)]
    seed = data.draw(st.integers(0, 1000))
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab, 6, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(kv * group * 2, 6, generator=g),
        "model.layers.0.self_attn.k_proj.bias": torch.randn(kv * 2, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(6, kv * group * 2, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(inter, 6, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(6, inter, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(6, generator=g),
    }
    for name, full in tensors.items():
        parts = [p.take(name, full) for p in plans]
        if name.endswith("layernorm.weight"):
            assert all(part is full for part in parts)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), full)
        else:
            assert torch.equal(torch.cat(parts, dim=0), full)
    bias = torch.randn(6, generator=g)
    parts = [p.take("model.layers.0.mlp.down_proj.bias", bias) for p in plans]
    assert torch.equal(parts[0], bias) and all(not p.any() for p in parts[1:])
    # A rank's query heads are the groups of its kv heads.
    for p in plans:
        assert p.q_heads == (p.kv_heads[0] * group, p.kv_heads[1] * group)


def test_smollm2_shape_splits_unevenly_over_two_ranks() -> None:
    """9 query heads over 3 kv heads (SmolLM2-135M): rank 0 takes 2 kv heads, rank 1 one."""
    s = spec(hidden_size=576, head_dim=64, intermediate_size=1536, vocab_size=49152)
    formats = {"model.layers.0.self_attn.o_proj": "Q4_1", "model.layers.0.mlp.down_proj": "Q4_1"}
    r0, r1 = (ShardPlan.build(s, r, 2, formats) for r in (0, 1))
    assert (r0.kv_heads, r0.q_heads, r1.kv_heads, r1.q_heads) == ((0, 2), (0, 6), (2, 3), (6, 9))
    assert (r0.intermediate, r1.intermediate) == ((0, 768), (768, 1536))


def test_a_split_inside_a_block_is_refused_clearly() -> None:
    # K-quant down_proj: 256-column blocks; 384 columns are one and a half blocks.
    with pytest.raises(ShardError, match="down_proj is kept in blocks of 256"):
        ShardPlan.build(spec(intermediate_size=384), 0, 2, {"model.layers.0.mlp.down_proj": "Q4_K"})
    # o_proj: 3 query heads of 16 columns per rank = 48 columns, not whole 32-column blocks.
    with pytest.raises(ShardError, match="o_proj is kept in blocks of 32"):
        ShardPlan.build(spec(num_heads=6, num_kv_heads=2), 0, 2,
                        {"model.layers.0.self_attn.o_proj": "Q8_0"})


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_parallel=2, data_parallel=2), "cannot be combined"),
    (dict(tensor_parallel=2, api_workers=2), "cannot be combined"),
    (dict(tensor_parallel=2, model="fake"), "needs a real model"),
    (dict(tensor_parallel=2, speculative="draft", speculative_draft_model=__file__),
     "speculative 'draft'"),
    (dict(tensor_parallel=2, nnodes=2), "needs dist_init_addr"),
    (dict(tensor_parallel=3, nnodes=2, dist_init_addr="h:1"), "not a multiple of nnodes"),
    (dict(tensor_parallel=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "below nnodes"),
    (dict(nnodes=2, dist_init_addr="h:1"), "needs tensor_parallel"),
    (dict(tensor_parallel=2, dist_init_addr="nohost"), "expected host:port"),
    (dict(tensor_parallel=0), "tensor_parallel"),
])
def test_bad_combinations_are_refused(kw, match) -> None:
    with pytest.raises(ValidationError, match=match):
        Settings(**kw)


# -- real groups ----------------------------------------------------------------------------------


async def greedy(settings: Settings, prompts: list[list[int]],
                 in_process: bool = False) -> list[list[tuple[int, float]]]:
    """Each prompt's greedy (token, logprob) pairs, all prompts in one batch: of a real worker
    process (a group's rank 0 with tensor_parallel), or ``in_process`` of an engine this process
    builds (the one-worker reference, without a process start)."""
    engine = None
    if in_process:
        from trio_infer.engine.engine import Engine
        from trio_infer.models.loader import load_model

        engine = Engine(load_model(settings.model), settings.engine_config())
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                             logprobs=0)]
    got: dict[int, list[tuple[int, float]]] = {}
    with trio.fail_after(300):
        connect = serve_in_process(engine) if engine is not None else None
        async with open_engine(settings, connect) as async_engine:
            async with async_engine.generate_batch(prompts, params) as stream:
                async for outs in stream:
                    for o in outs:
                        for token, lp in zip(o.token_ids, o.logprobs or []):
                            got.setdefault(o.uid[1], []).append((token, lp.logprob))
    return [got[i] for i in range(len(prompts))]


def assert_same_greedy(one: list, group: list) -> None:
    for a, b in zip(one, group, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert len(a) == MAX_TOKENS
        worst = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
        assert worst < LOGPROB_TOL


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def base_settings(model: Path | str, tmp_path: Path, **kw) -> Settings:  # type: ignore[no-untyped-def]
    return Settings(model=str(model), cache_dir=tmp_path, torch_threads=2, kv_cache_mb=16,
                    kv_cache_dtype="float32", worker_restart_delay_s=0.1, **kw)


CHECKPOINTS = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen2-bias-untied": ("Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "phi3": ("Phi3ForCausalLM", {}),  # its fused q/k/v and gate/up split before the shard plan
}


# Each case starts a group of two processes (~15-20 s on 2 cores): by default Llama runs (and
# SmolLM2's GGUF below, a Llama too); Qwen2's biases, Qwen3's q/k norms and Phi-3's stored fused
# projections with TRIO_INFER_TP_FULL=1, which keeps `make test` under its time budget on the
# 2-core CI.
TP_FULL = os.environ.get("TRIO_INFER_TP_FULL") == "1"
FULL_ONLY = pytest.mark.skipif(not TP_FULL, reason="TRIO_INFER_TP_FULL=1 runs it")


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name == "llama" else FULL_ONLY) for name in CHECKPOINTS])
async def test_two_ranks_give_the_greedy_ids_of_one(name, tiny_checkpoint_factory,
                                                    tmp_path) -> None:
    architecture, overrides = CHECKPOINTS[name]
    path = tiny_checkpoint_factory(architecture, **overrides)
    prompts = prompts_for(1024)
    one = await greedy(base_settings(path, tmp_path), prompts, in_process=True)
    two = await greedy(base_settings(path, tmp_path, tensor_parallel=2), prompts)
    assert_same_greedy(one, two)


@pytest.mark.skipif(not SMOLLM2.is_file(), reason="the default GGUF is not fetched")
async def test_two_ranks_of_smollm2_gguf_give_the_greedy_ids_of_one(tmp_path) -> None:
    """Kept Q4_1 blocks, cut between blocks; 3 kv heads split 2 + 1."""
    prompts = prompts_for(49152)
    one = await greedy(base_settings(SMOLLM2, tmp_path), prompts, in_process=True)
    two = await greedy(base_settings(SMOLLM2, tmp_path, tensor_parallel=2), prompts)
    assert_same_greedy(one, two)


def test_a_model_with_too_few_kv_heads_is_refused_at_load(tiny_checkpoint) -> None:
    """Checked before any weight is read or any rank joins: rank 0's load fails with the reason,
    which the worker reports as its Fatal (the front end logs it and stops)."""
    from trio_infer.models.loader import load_model

    with pytest.raises(ShardError, match="tensor_parallel 4 exceeds the model's 2 kv heads"):
        load_model(tiny_checkpoint, shard=(0, 4))


async def test_two_nodes_over_a_tcp_rendezvous_give_the_greedy_ids_of_one(
        tiny_checkpoint_factory, tmp_path) -> None:
    """Node 1 is ``serve --node-rank 1`` (its follower rank only, no server); node 0 is a worker
    whose group has no local follower: the two meet at --dist-init-addr over loopback."""
    from .test_worker_process import alive, children, free_port, wait_for

    path = tiny_checkpoint_factory("LlamaForCausalLM")
    prompts = prompts_for(1024)
    one = await greedy(base_settings(path, tmp_path), prompts, in_process=True)
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen(
        [sys.executable, "-m", "trio_infer", "serve", "--model", str(path), "--cache-dir",
         str(tmp_path), "--torch-threads", "1", "--tensor-parallel", "2", "--nnodes", "2",
         "--node-rank", "1", "--dist-init-addr", addr, "--worker-restart-delay-s", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        two = await greedy(base_settings(path, tmp_path, tensor_parallel=2, nnodes=2,
                                         dist_init_addr=addr), prompts)
        assert_same_greedy(one, two)
        # The group ended with node 0's worker: node 1 starts its rank again, ready to rejoin.
        wait_for(lambda: len(children(node1.pid)) == 1, 60, "node 1's rank to be restarted")
        [rank] = children(node1.pid)
        node1.send_signal(signal.SIGTERM)
        output, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, output[-3000:]
        assert not alive(rank)
        assert "the group ended; starting its ranks again" in output, output[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def serve_two_ranks(checkpoint: Path, tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """``serve --tensor-parallel 2`` on ``checkpoint`` (served as "tiny"), once healthy."""
    from .test_worker_process import free_port, health, wait_for

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trio_infer", "serve", "--model", str(checkpoint),
         "--served-model-name", "tiny", "--port", str(port), "--cache-dir", str(tmp_path),
         "--torch-threads", "2", "--tensor-parallel", "2", "--kv-cache-mb", "16",
         "--shutdown-grace-s", "1", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_for(lambda: health(url) == 200 or proc.poll() is not None, 180, "the group")
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    return proc, url


def test_a_follower_rank_killed_under_load_ends_the_group_and_it_serves_again(
        tiny_checkpoint, tmp_path) -> None:
    """``serve --tensor-parallel 2``: under 8 streams, ``kill -9`` of rank 1 (the worker's
    child): every stream ends exactly once, with all its tokens or the worker-death error; the
    front end restarts the whole group (a new worker and a new rank 1), which serves again, and
    the gauges are back to 0."""
    import httpx

    from .test_worker_process import alive, children, health, start_streams, wait_for

    proc, url = serve_two_ranks(tiny_checkpoint, tmp_path, "--worker-restart-delay-s", "0.1")
    try:
        [worker] = children(proc.pid)
        [rank1] = children(worker)
        status = httpx.get(url + "/v1/status").json()
        assert status["tensor_parallel"] == 2, status
        results, threads = start_streams(url, 8, 2000, model="tiny", prompt="hello there")
        os.kill(rank1, signal.SIGKILL)
        for t in threads:
            t.join(timeout=180)
        assert all(isinstance(r, list) for r in results), results
        for events in results:
            assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
            ends = [e for e in events[:-1]
                    if "error" in e or e["choices"][0].get("finish_reason") is not None]
            assert len(ends) == 1, ends  # exactly one end: its tokens, or the error
        failed = [r for r in results if "error" in r[-2]]
        assert failed, "the rank was killed after every stream had finished"
        assert all(r[-2]["error"]["code"] == "service_unavailable" for r in failed)

        wait_for(lambda: health(url) == 200 and worker not in children(proc.pid)
                 and len(children(proc.pid)) == 1, 180, "the group to be restarted")
        assert not alive(worker) and not alive(rank1)
        [new_worker] = children(proc.pid)
        wait_for(lambda: len(children(new_worker)) == 1, 60, "the new rank 1")
        ok = [httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": f"again {i}", "max_tokens": 5}) for i in range(3)]
        assert all(r.status_code == 200 for r in ok), [r.text for r in ok]
        metrics = httpx.get(url + "/metrics").text
        for line in ("trio_infer_sessions_active 0.0", "trio_infer_requests_running 0.0"):
            assert line in metrics, line
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output[-3000:]
        assert output.count("restarting the batching worker (1 of at most") == 1, output[-3000:]
        wait_for(lambda: not alive(new_worker), 30, "the worker to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_follower_rank_stopped_is_a_stall_seen_before_the_collective_timeout(
        tiny_checkpoint, tmp_path) -> None:
    """``serve --tensor-parallel 2`` under 8 streams, rank 1 stopped with SIGSTOP (alive, its
    sockets open): rank 0 waits in a collective (whose timeout is 120 s) and no step ends, so the
    front end's watchdog says so past its stall bound, long before; SIGCONT and the group goes on,
    every stream ending with all its tokens."""
    import httpx

    from .test_worker_process import children, health, start_streams, wait_for

    proc, url = serve_two_ranks(tiny_checkpoint, tmp_path, "--watchdog-stall-s", "1.5",
                                "--watchdog-restart-s", "100")
    try:
        [worker] = children(proc.pid)
        [rank1] = children(worker)
        results, threads = start_streams(url, 8, 300, model="tiny", prompt="hello there")
        os.kill(rank1, signal.SIGSTOP)
        try:
            took = wait_for(lambda: health(url) == 503, 60, "/health to say 503")
            assert took < 30, f"the stall was seen after {took:.1f} s"
            assert "no progress for" in httpx.get(url + "/v1/status").json()["problem"]
        finally:
            os.kill(rank1, signal.SIGCONT)
        wait_for(lambda: health(url) == 200, 60, "/health to say 200 again")
        for t in threads:
            t.join(timeout=180)
        for events in results:
            assert isinstance(events, list), events
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert children(proc.pid) == {worker} and children(worker) == {rank1}  # the same group
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
