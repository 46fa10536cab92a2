"""guidellm (vLLM's load generator) against the server: a short concurrent run on chat
completions (its default) ends with every request successful and none errored; on completions
too with ``TRIO_INFER_CLIENTS_FULL=1`` (a run costs ~25-35 s, mostly guidellm's start and its
worker process, so ``make test`` runs one). guidellm sends vLLM's fields (``ignore_eos``,
``stream_options.continuous_usage_stats``) and reads the output tokens from the streamed usage,
so each request's count is exactly what it asked for. Its synthetic prompts are made with the
checkpoint's own tokenizer, from the local folder (``--tokenizer``): nothing is fetched from a
hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("guidellm") is None:  # not imported here: it is run as a command
    pytest.skip("guidellm is not installed (the 'clients' extra)", allow_module_level=True)

from api.test_server import Server  # noqa: E402

from .conftest import run_client  # noqa: E402

REQUESTS, OUTPUT_TOKENS = 4, 8
FULL = os.environ.get("TRIO_INFER_CLIENTS_FULL") == "1"


@pytest.mark.parametrize("endpoint", [
    "/v1/chat/completions",
    pytest.param("/v1/completions", marks=pytest.mark.skipif(not FULL, reason="TRIO_INFER_CLIENTS_FULL=1 runs it")),
])
def test_concurrent_run_has_no_errored_request(idle: Server, checkpoint: Path, tmp_path: Path,
                                               endpoint: str) -> None:
    report = tmp_path / "report.json"
    # One worker process: guidellm starts one per core by default, each a few seconds of imports.
    run_client([
        "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={idle.url},request_format={endpoint}",
        "--profile", "kind=concurrent,streams=2",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={checkpoint}",
        "--output", f"kind=json,path={report}",
        "--disable-console",
    ], tmp_path, {"GUIDELLM__MAX_WORKER_PROCESSES": "1"})
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    for request in benchmark["requests"]["successful"]:
        sent = json.loads(request["request_args"])["body"]
        assert sent["stream"] is True and sent["ignore_eos"] is True
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
        assert request["output"]  # the text it read from the stream
