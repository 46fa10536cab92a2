"""lm-evaluation-harness against the server, on two tiny local tasks (a JSONL file each, written
here: nothing comes from a hub): ``local-completions`` scores a multiple-choice task by
loglikelihood (``echo`` with ``logprobs`` on token-id prompts, two prompts a request) and
generates until a stop string; ``local-chat-completions`` generates through the chat template.
Each run is lm-eval's Python API in a subprocess, with only these tasks indexed (its command line
indexes its thousands of built-in tasks first: ~15 s), and lm-eval's numbers are checked
against the server's own answers to the same requests.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

if importlib.util.find_spec("lm_eval") is None:  # not imported here: it is run in a subprocess
    pytest.skip("lm-eval is not installed (the 'clients' extra)", allow_module_level=True)

from api.test_server import Server  # noqa: E402

from .conftest import run_client  # noqa: E402

MC = [
    {"question": "The harbour is", "choices": ["open", "closed"], "answer": 0},
    {"question": "The sky over the sea is", "choices": ["blue", "green", "grey"], "answer": 0},
]
GEN = [
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "What is two plus two?", "answer": "4"},
]
MAX_GEN = 8

# lm-eval's API, as its command line would run it, with the tasks of one folder only.
RUN = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
model, args, tasks, folder, chat, out = sys.argv[1:]
results = lm_eval.simple_evaluate(
    model=model, model_args=json.loads(args), tasks=tasks.split(","), limit=2, log_samples=True,
    apply_chat_template=chat == "1", task_manager=TaskManager(include_path=folder, include_defaults=False))
json.dump({"results": results["results"], "samples": results["samples"]}, open(out, "w"), default=str)
"""


def _tasks(folder: Path) -> None:
    """The two tasks' files in ``folder``."""
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
    (folder / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "trio_mc.yaml").write_text(
        f"task: trio_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (folder / "trio_gen.yaml").write_text(
        f"task: trio_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_target: '{{answer}}'\n"
        f"generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def _evaluate(tmp_path: Path, model: str, args: dict[str, Any], tasks: str, chat: bool) -> dict[str, Any]:
    out = tmp_path / "results.json"
    folder = tmp_path / "tasks"
    folder.mkdir()
    _tasks(folder)
    run_client(["-c", RUN, model, json.dumps(args), tasks, str(folder), "1" if chat else "0", str(out)], tmp_path)
    return json.loads(out.read_text())


def _continuation_logprob(server: Server, context: str, continuation: str) -> float:
    """The server's logprob of ``continuation`` after ``context``: the echoed prompt's logprobs
    of the tokens that start at or after the continuation's first character."""
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": server.model, "prompt": context + continuation, "max_tokens": 0, "echo": True,
        "logprobs": 1}).json()
    lp = r["choices"][0]["logprobs"]
    return sum(p for p, at in zip(lp["token_logprobs"], lp["text_offset"]) if at >= len(context))


def test_local_completions_loglikelihood_and_generation(idle: Server, checkpoint: Path, tmp_path: Path) -> None:
    args = {"base_url": idle.url + "/v1/completions", "model": idle.model, "tokenizer": str(checkpoint),
            "num_concurrent": 2, "max_retries": 1, "batch_size": 2}
    found = _evaluate(tmp_path, "local-completions", args, "trio_mc,trio_gen", chat=False)
    assert set(found["results"]) == {"trio_mc", "trio_gen"}
    assert found["results"]["trio_mc"]["acc,none"] in (0.0, 0.5, 1.0)
    scored = found["samples"]["trio_mc"]
    assert len(scored) == 2
    for sample in scored:
        # each choice is one (context, continuation) request, and its response (loglikelihood,
        # is greedy)
        asked = sample["arguments"]
        assert len(asked) == len(sample["resps"]) == len(sample["doc"]["choices"])
        for (context, continuation), [resp] in zip(asked, sample["resps"]):
            loglikelihood = float(resp[0])
            assert math.isfinite(loglikelihood) and loglikelihood < 0
            assert loglikelihood == pytest.approx(_continuation_logprob(idle, context, continuation), abs=1e-3)
    for sample in found["samples"]["trio_gen"]:
        [[said]] = sample["resps"]
        direct = httpx.post(idle.url + "/v1/completions", timeout=60, json={
            "model": idle.model, "prompt": f"Q: {sample['doc']['question']}\nA:", "max_tokens": MAX_GEN,
            "temperature": 0, "stop": ["\n"], "seed": 1234}).json()
        assert said == direct["choices"][0]["text"]


def test_local_chat_completions_generation(idle: Server, tmp_path: Path) -> None:
    args = {"base_url": idle.url + "/v1/chat/completions", "model": idle.model, "num_concurrent": 2,
            "max_retries": 1}
    found = _evaluate(tmp_path, "local-chat-completions", args, "trio_gen", chat=True)
    assert found["results"]["trio_gen"]["exact_match,none"] in (0.0, 0.5, 1.0)
    samples = found["samples"]["trio_gen"]
    assert len(samples) == 2
    for sample in samples:
        [[said]] = sample["resps"]
        direct = httpx.post(idle.url + "/v1/chat/completions", timeout=60, json={
            "model": idle.model, "messages": [{"role": "user", "content": f"Q: {sample['doc']['question']}\nA:"}],
            "max_tokens": MAX_GEN, "temperature": 0, "stop": ["\n"], "seed": 1234}).json()
        assert said == direct["choices"][0]["message"]["content"]
