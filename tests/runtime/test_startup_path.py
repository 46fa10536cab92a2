"""What the worker does before it is ready, and what it leaves for later (docs/architecture.md,
start-up): the grammars' tokenizer is loaded by the first constrained request, not by the load,
and loading a GGUF model imports neither transformers nor torch's compiler stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import llguidance
import pytest

from trio_infer.engine.grammar import Grammars
from trio_infer.models.default_model import default_cache_dir, default_model_file
from trio_infer.models.loader import load_tokenizer

SMOLLM2 = default_model_file(default_cache_dir())
REGEX = llguidance.LLMatcher.grammar_from_regex("ab")


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path) -> Any:
    return load_tokenizer(tiny_checkpoint)


def test_deferred_grammars_load_the_tokenizer_on_the_first_matcher_only(tokenizer: Any) -> None:
    loads: list[int] = []

    def load() -> Any:
        loads.append(1)
        return tokenizer

    grammars = Grammars.deferred(load, len(tokenizer), [0])
    assert loads == [] and grammars.num_cached == 0
    first = grammars.matcher(REGEX)
    assert loads == [1]
    assert not first.is_error()
    grammars.matcher(llguidance.LLMatcher.grammar_from_regex("c+"))
    assert loads == [1] and grammars.num_cached == 2


def test_a_tokenizer_that_fails_to_load_refuses_the_request_and_is_tried_again(
        tokenizer: Any) -> None:
    attempts: list[int] = []

    def load() -> Any:
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("the tokenizer cache is unreadable")
        return tokenizer

    grammars = Grammars.deferred(load, len(tokenizer), [0])
    with pytest.raises(ValueError, match="tokenizer for grammars could not be built.*unreadable"):
        grammars.matcher(REGEX)  # the worker refuses this one request (a ValueError)
    assert grammars.matcher(REGEX) is not None
    assert len(attempts) == 2


LOAD_AND_LIST_MODULES = """
import json, sys
from trio_infer.runtime.loading import build_engine
from trio_infer.settings import Settings
engine = build_engine(Settings(model=sys.argv[1], cache_dir=sys.argv[2]))
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.skipif(not SMOLLM2.is_file(), reason=f"the default model is not at {SMOLLM2}")
def test_loading_a_gguf_model_imports_no_transformers_and_no_compiler(tmp_path: Path) -> None:
    """transformers (about a second) and torch's dynamo/inductor (2-3 s, through
    llguidance.torch's torch.compile decorator) were most of the worker's start-up."""
    out = subprocess.run(
        [sys.executable, "-c", LOAD_AND_LIST_MODULES, str(SMOLLM2), str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    modules = json.loads(out.strip().splitlines()[-1])
    heavy = [m for m in modules if m.split(".")[0] == "transformers"
             or m.startswith(("torch._dynamo", "torch._inductor", "llguidance.torch",
                              "llguidance.hf"))]
    assert "trio_infer.engine.grammar" in modules and "trio_infer.models.gguf_meta" in modules
    assert not heavy, heavy[:10]
    assert not (tmp_path / "cache" / "tokenizers").exists()  # the tokenizer was never loaded
