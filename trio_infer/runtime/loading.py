"""Turn :class:`~trio_infer.settings.Settings` into a ready engine (in the worker process; the
tokenizer alone is ``runtime/tokenizer.py``).

torch is imported only where a torch model is built: a GGUF model that the CPU kernels serve
(models/cpu_llama.py) and the fake model run without it, and a worker that never imports it
saves ~220 MiB of resident memory."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from trio_infer.engine.engine import Engine
from trio_infer.runtime.tokenizer import FAKE_MODEL, build_tokenizer
from trio_infer.settings import Settings

# ``progress(phase, done, total)``: where a load stands (see protocol.Loading).
Progress = Callable[[str, "int | None", "int | None"], None]


def configure_torch_threads(settings: Settings) -> int:
    """Pick torch's intra-op thread count deliberately: the event loop needs a core slice too
    (see docs/architecture.md): ``Settings.worker_threads``."""
    import torch

    n = settings.worker_threads()
    torch.set_num_threads(n)
    return n


def resolve_device(settings: Settings) -> str:
    if settings.device == "auto":
        return "cuda" if _cuda_available() else "cpu"
    return settings.device


def _cuda_available() -> bool:
    """Whether torch sees a GPU, asked only where an NVIDIA driver is installed: importing torch
    just to learn that a CPU-only machine has none would cost its worker ~220 MiB."""
    if not any(os.path.exists(p) for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl")):
        return False
    import torch

    return torch.cuda.is_available()


def _dtype(settings: Settings) -> str | None:
    return None if settings.dtype == "auto" else settings.dtype


def _uses_torch(model: Any) -> bool:
    from trio_infer.models.cpu_llama import CpuLlama

    return not isinstance(model, CpuLlama)


def build_engine(settings: Settings, progress: Progress | None = None) -> Engine:
    """Load the model the settings name into an engine (slow: the worker process does it),
    telling ``progress`` how far it got. With ``tensor_parallel`` > 1 this process becomes rank 0
    of a group (runtime/tp_group.py): the model is its slice, wrapped to lead the others."""
    report: Progress = progress or (lambda phase, done, total: None)
    if settings.tensor_parallel > 1:
        return _build_group_engine(settings, report)
    device = resolve_device(settings)
    config = settings.engine_config()
    if settings.model == FAKE_MODEL:
        from trio_infer.models.fake import FakeModel

        report("engine", None, None)
        tokenizer = build_tokenizer(settings)
        model = FakeModel(
            vocab_size=len(tokenizer),
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            name=settings.served_model_name or FAKE_MODEL,
            step_s=settings.fake_step_ms / 1000,
        )
        draft = None
        if settings.speculative_draft_model is not None:
            draft = load_draft_model(settings, "cpu", None, report)
        return Engine(model, config, device="cpu",
                      grammars=build_grammars(model, lambda: tokenizer), draft_model=draft)

    from trio_infer.models.loader import load_model, resolve_model_path

    path = resolve_model_path(settings.model, settings.cache_dir)
    dtype = _dtype(settings)
    with _counting_tensors(report):
        model = load_model(path, dtype=dtype, device=device, served_name=settings.served_model_name,
                           keep_blocks=None if settings.keep_gguf_blocks else False,
                           activations=settings.activations, threads=settings.worker_threads())
    if _uses_torch(model):
        configure_torch_threads(settings)
    draft = None
    if settings.speculative_draft_model is not None:
        draft = load_draft_model(settings, device, dtype, report)
    report("engine", None, None)
    return Engine(model, config, device=device,
                  grammars=build_grammars(model, lambda: build_tokenizer(settings)),
                  draft_model=draft)


def load_draft_model(settings: Settings, device: str, dtype: Any, report: Progress) -> Any:
    """The draft model of ``speculative=draft``, after checking that its tokenizer's vocabulary
    is the model's (the same ids for the same strings: the draft's guesses are the model's
    tokens); raises ValueError naming the setting otherwise."""
    from trio_infer.models.loader import load_model, resolve_model_path

    path = settings.speculative_draft_model
    assert path is not None
    draft_settings = settings.model_copy(update={"model": path, "speculative_draft_model": None})
    if build_tokenizer(draft_settings).get_vocab() != build_tokenizer(settings).get_vocab():
        raise ValueError(f"speculative_draft_model {path!r}: its tokenizer's vocabulary differs "
                         "from the model's; the draft model must share the model's tokenizer")
    with _counting_tensors(report):
        draft = load_model(resolve_model_path(path, settings.cache_dir), dtype=dtype, device=device,
                           keep_blocks=None if settings.keep_gguf_blocks else False,
                           activations=settings.activations, threads=settings.worker_threads())
    if _uses_torch(draft):
        configure_torch_threads(settings)
    return draft


def load_shard(settings: Settings, rank: int, size: int, device: str) -> Any:
    """Rank ``rank`` of ``size``'s slice of the model the settings name (a follower's whole load;
    rank 0's through :func:`build_engine`)."""
    from trio_infer.models.loader import load_model, resolve_model_path

    path = resolve_model_path(settings.model, settings.cache_dir)
    return load_model(path, dtype=_dtype(settings), device=device,
                      served_name=settings.served_model_name,
                      keep_blocks=None if settings.keep_gguf_blocks else False,
                      activations=settings.activations, shard=(rank, size))


def _build_group_engine(settings: Settings, report: Progress) -> Engine:
    """Rank 0 of a tensor-parallel group: start the followers, load the slice, lead them."""
    import torch

    from trio_infer.runtime import tp_group

    layout = tp_group.Layout.of(settings)
    torch.set_num_threads(tp_group.rank_threads(settings, layout))
    device = resolve_device(settings)

    def load(rank: int, size: int, rank_device: str) -> Any:
        with _counting_tensors(report):
            return load_shard(settings, rank, size, rank_device)

    leader = tp_group.build_leader(settings, layout, load, device)
    report("engine", None, None)
    engine = Engine(leader, settings.engine_config(),
                    device=tp_group.rank_device(device, 0, layout),
                    grammars=build_grammars(leader, lambda: build_tokenizer(settings)))
    cache = engine.kv_cache
    leader.announce_cache(cache.num_pages, cache.page_size, cache.dtype)
    return engine


def build_grammars(model: Any, load_tokenizer: Callable[[], Any]) -> Any:
    """The compiler of constrained requests' grammars, over the model's vocabulary (its logits
    may be wider than the tokenizer: those ids are never allowed). ``load_tokenizer`` is called
    by the first constrained request, not now: the worker is ready without the tokenizer
    (loading it and building llguidance's tables would add a second or two to every start, for
    requests most workers never get)."""
    from trio_infer.engine.grammar import Grammars

    info = model.info
    return Grammars.deferred(load_tokenizer, info.vocab_size, info.eos_token_ids)


@contextmanager
def _counting_tensors(report: Progress) -> Iterator[None]:
    """Report ``("weights", loaded, total)`` as the model loaders read tensors.

    Both loaders (``models/loader.py``, ``models/gguf_loader.py``) already count the tensors they
    read, in a tqdm bar; for the duration of a load their ``tqdm`` is a subclass that also reports
    each count, so the models package needs no callback parameter for it."""
    from tqdm import tqdm

    from trio_infer.models import gguf_loader, loader

    class Counting(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            report("weights", 0, self.total)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            report("weights", int(self.n), self.total)
            return shown

    modules = (loader, gguf_loader)
    for module in modules:
        module.tqdm = Counting  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in modules:
            module.tqdm = tqdm  # type: ignore[attr-defined]
