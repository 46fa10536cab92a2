"""The grounded workload: requests whose answer copies long spans of their prompt.

Summaries, rewrites and code edits of a given text are where prompt lookup (speculative
decoding, engine/speculative.py) guesses right for free, so ``offline --workload grounded``
measures it there: each request is a chat turn about a text given in it, rendered with the
model's chat template. The prompts are fixed text; only their order and output lengths are
drawn from the seed.

The prompts come in kinds (:data:`KINDS`), measured one kind or a mix at a time
(``--grounded-kinds``), because how much an answer copies depends on what was asked:
``rewrite`` and ``summarize`` a passage (a small model paraphrases as much as it copies),
``rename`` a variable in a real code file (a function of this package's own workload module);
and three tasks whose answer a user expects to be the given text with a small change:
``typo`` (fix a misspelt name in a real function of the same module), ``json`` (return a JSON object with one field
changed) and ``proofread`` (correct the spelling mistakes of a passage and return it whole).
The default mix is the first three (docs/benchmarks.md has its figures).
"""

from __future__ import annotations

import inspect
import json
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

TYPO_TASK = ("This Python function does not run: one name in it is misspelt. Fix the typo and "
             "return the whole corrected function.\n\n```python\n{code}```")

# (a name as the function spells it, the misspelling put in its place once)
TYPO = ("output = sum(out_tokens)", "output = sum(out_tokns)")

JSON_TASK = ("Here is an order as JSON:\n\n```json\n{data}\n```\n\nReturn the same JSON with "
             "\"status\" changed to \"shipped\". Return only the JSON.")

ORDER = {
    "id": "ord_20261202_0042",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com",
                 "address": {"street": "12 St James's Square", "city": "London",
                             "postcode": "SW1Y 4JH", "country": "GB"}},
    "items": [
        {"sku": "BK-1043", "title": "Sketch of the Analytical Engine", "quantity": 1,
         "unit_price": 24.5},
        {"sku": "PN-0007", "title": "Fountain pen, black ink", "quantity": 2, "unit_price": 12.0},
        {"sku": "NB-0311", "title": "Squared notebook, A5", "quantity": 3, "unit_price": 4.75},
    ],
    "currency": "GBP",
    "total": 62.75,
    "status": "paid",
    "notes": "Leave the parcel with the porter if nobody answers.",
}

PROOFREAD_TASK = ("Correct the spelling mistakes in the following passage and return the whole "
                  "passage, otherwise unchanged:\n\n{text}")

# (a word of the passage, its misspelling), three per passage
MISSPELLINGS = (
    (("bakers", "bakres"), ("narrow", "narow"), ("remember", "remeber")),
    (("expected", "expectd"), ("describing", "describeing"), ("usually", "usualy")),
    (("absorbs", "absorbes"), ("electrons", "electorns"), ("molecules", "molecues")),
)

KINDS = ("rewrite", "summarize", "rename", "typo", "json", "proofread")
DEFAULT_KINDS = ("rewrite", "summarize", "rename")


def code_file() -> str:
    """The code the edit task works on: a real function of this package."""
    return inspect.getsource(_workload_module.make_workload)


def _misspelt(text: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for right, wrong in pairs:
        assert right in text, right
        text = text.replace(right, wrong, 1)
    return text


def kind_prompts(kind: str) -> list[str]:
    """The prompts of one kind, as the user's message."""
    if kind == "rewrite":
        return [TASKS[0].format(text=p) for p in PASSAGES]
    if kind == "summarize":
        return [TASKS[1].format(text=p) for p in PASSAGES]
    if kind == "rename":
        return [CODE_TASK.format(code=code_file())]
    if kind == "typo":
        return [TYPO_TASK.format(code=_misspelt(inspect.getsource(_workload_module.make_result), (TYPO,)))]
    if kind == "json":
        return [JSON_TASK.format(data=json.dumps(ORDER, indent=2))]
    if kind == "proofread":
        return [PROOFREAD_TASK.format(text=_misspelt(p, m)) for p, m in zip(PASSAGES, MISSPELLINGS)]
    raise ValueError(f"unknown grounded kind {kind!r}: expected one of {', '.join(KINDS)}")


def grounded_prompts(kinds: tuple[str, ...] = DEFAULT_KINDS) -> list[str]:
    """Every prompt of the given kinds, as the user's message (the default kinds in the order
    of the first measurements, so that a seed draws the same workload as then)."""
    if tuple(kinds) == DEFAULT_KINDS:  # passage by passage, then the code edit
        prompts = [task.format(text=p) for p in PASSAGES for task in TASKS]
        return [*prompts, CODE_TASK.format(code=code_file())]
    return [text for kind in kinds for text in kind_prompts(kind)]


def make_grounded_workload(tokenizer: Any, num_prompts: int, output_len: LengthRange,
                           seed: int = 0, kinds: tuple[str, ...] = DEFAULT_KINDS
                           ) -> list[BenchRequest]:
    """``num_prompts`` requests cycling through the prompts of ``kinds`` in a seeded order, each
    rendered with the tokenizer's chat template (with the generation prompt)."""
    rng = random.Random(seed)
    texts = grounded_prompts(kinds)
    rng.shuffle(texts)
    out = []
    for i in range(num_prompts):
        messages = [{"role": "user", "content": texts[i % len(texts)]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        out.append(BenchRequest(list(ids), output_len.draw(rng)))
    return out
