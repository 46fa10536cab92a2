"""The grounded workload: requests whose answer copies long spans of their prompt.

Summaries, rewrites and code edits of a given text are where prompt lookup (speculative
decoding, engine/speculative.py) guesses right for free, so ``offline --workload grounded``
measures it there: each request is a chat turn asking to rewrite or summarize one of the
passages below, or to make a small edit to a real code file (a function of this package's own
workload module), rendered with the model's chat template. The prompts are fixed text; only
their order and output lengths are drawn from the seed.
"""

from __future__ import annotations

import inspect
import random
from typing import Any

from trio_infer.bench import workload as _workload_module
from trio_infer.bench.workload import BenchRequest, LengthRange

PASSAGES = (
    "The river town woke slowly in winter. Before dawn the bakers lit their ovens, and the "
    "smell of bread drifted down the narrow streets to the docks, where the ferrymen were "
    "already chipping ice from the ropes. By eight the market square filled with carts of "
    "apples, onions and cabbages brought in from the farms on the hill. Children ran between "
    "the stalls on their way to school, and the old clock on the town hall, which had been "
    "five minutes slow for as long as anyone could remember, struck the hour.",
    "A good bug report says what you did, what you expected to happen, and what happened "
    "instead. It gives the exact version of the program, the operating system, and the "
    "smallest input that shows the problem. It copies error messages as text rather than "
    "describing them, and it says whether the problem happens every time or only sometimes. "
    "A maintainer who can reproduce a bug in five minutes will usually fix it; one who cannot "
    "reproduce it will usually ask questions, and the report waits.",
    "Photosynthesis turns light into chemical energy. In the leaves of a plant, chlorophyll "
    "absorbs red and blue light and uses its energy to split water into oxygen, protons and "
    "electrons. The electrons pass along a chain of proteins in the membrane of the "
    "chloroplast, and the energy they release is stored in two small molecules, ATP and NADPH. "
    "In a second set of reactions, which do not need light, the plant uses these molecules to "
    "turn carbon dioxide from the air into sugar.",
)

TASKS = (
    "Rewrite the following passage in clear, simple English, keeping every fact:\n\n{text}",
    "Summarize the following passage in a few sentences, reusing its own words where you "
    "can:\n\n{text}",
)

CODE_TASK = ("Here is a Python function:\n\n```python\n{code}```\n\nRename the variable `rng` to "
             "`generator` everywhere in it and return the whole function.")


def code_file() -> str:
    """The code the edit task works on: a real function of this package."""
    return inspect.getsource(_workload_module.make_workload)


def grounded_prompts() -> list[str]:
    """Every prompt of the workload, as the user's message."""
    prompts = [task.format(text=p) for p in PASSAGES for task in TASKS]
    prompts.append(CODE_TASK.format(code=code_file()))
    return prompts


def make_grounded_workload(tokenizer: Any, num_prompts: int, output_len: LengthRange,
                           seed: int = 0) -> list[BenchRequest]:
    """``num_prompts`` requests cycling through the prompts in a seeded order, each rendered with
    the tokenizer's chat template (with the generation prompt)."""
    rng = random.Random(seed)
    texts = grounded_prompts()
    rng.shuffle(texts)
    out = []
    for i in range(num_prompts):
        messages = [{"role": "user", "content": texts[i % len(texts)]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        out.append(BenchRequest(list(ids), output_len.draw(rng)))
    return out
