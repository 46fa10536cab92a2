"""``python -m trio_infer generate`` on a transformers-saved checkpoint matches transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_generate_cli_matches_transformers(tiny_checkpoint_factory, tmp_path: Path) -> None:
    path = tiny_checkpoint_factory("LlamaForCausalLM")
    prompt = "The quick brown fox jumps over the lazy dog"
    out = subprocess.run(
        [sys.executable, "-m", "trio_infer", "generate", "--model", str(path), "--prompt", prompt,
         "--max-tokens", "24", "--temperature", "0", "--json", "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)

    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    want = hf.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0)[0, ids.shape[1]:]
    want = want.tolist()
    # transformers stops at an EOS like we do; either way the token ids must agree.
    assert got["token_ids"] == want
    assert got["finish_reason"] == ("length" if len(want) == 24 else "stop")
    assert got["text"] == tokenizer.decode(want, skip_special_tokens=True)


def test_a_broken_gguf_file_is_one_line_naming_it(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """generate on a file cut short: exit 1 and one line naming the file and the tensor; the
    traceback only with --log-level debug."""
    from tests.test_gguf import write_gguf

    good = write_gguf(tiny_checkpoint, tmp_path / "good.gguf", "Q8_0")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    command = [sys.executable, "-m", "trio_infer", "generate", "--model", str(broken), "--prompt", "hi",
               "--cache-dir", str(tmp_path / "cache")]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    [line] = out.stderr.splitlines()
    assert line.startswith("error: the model could not be loaded: ") and str(broken) in line
    assert "truncated or corrupt" in line and "tensor '" in line
    debug = subprocess.run(command + ["--log-level", "debug"], capture_output=True, text=True, timeout=120)
    assert debug.returncode == 1 and "Traceback" in debug.stderr
