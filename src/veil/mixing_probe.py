"""The forward-mixing probe: does one example move another example's output in a model's forward?

Per-sample clipping bounds one example's influence only if every example's output is computed from
that example alone. Batch statistics (BatchNorm in training mode, ``x.mean(0)``, attention across the
batch dimension) break this silently, so the engine runs this probe before training, and jobs run it
on a whole model (fixed front included) before any part is used alone.
A passing probe is evidence, not a proof: static validation (:func:`veil.validate`) runs first.

The probe never sees a private value: its verdict (and so whether a run is refused) must not depend
on any record. Jobs pass synthetic inputs drawn from the data's public description
(:func:`veil.pipeline.public_inputs.synthetic_inputs`); the engine, which knows only a user's
DataLoader, probes random values with the structure and dtypes of the dataset's items
(:func:`public_loaders`). Probing the first private rows let a mixing model pass when those rows
coincided and be refused when one record was added.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from veil.errors import ModelNotSupportedError, Problem

__all__ = ["probe_forward", "public_loaders", "refuse_example_mixing"]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _to(x: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and x.is_floating_point():
        return x.to(device=device, dtype=dtype)
    return x.to(device=device)


def _model_input(batch: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """The input part of a collated batch: the batch itself, the first field of a tuple/list, or a
    dict of keyword inputs (a Hugging Face batch: ``module(**batch)``); None if none of these."""
    if isinstance(batch, Mapping):
        if not any(isinstance(v, torch.Tensor) for v in batch.values()):
            return None
        return {k: _to(v, device, dtype) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    x = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if not isinstance(x, torch.Tensor):
        return None
    return _to(x, device, dtype)


def _rows(x: Any) -> tuple[int, ...]:
    """The leading dimension of the input (of its first tensor, for keyword inputs)."""
    if isinstance(x, Mapping):
        x = next((v for v in x.values() if isinstance(v, torch.Tensor)), None)
    return tuple(x.shape[:1]) if isinstance(x, torch.Tensor) else ()


def _call(module: nn.Module, x: Any) -> Any:
    return module(**x) if isinstance(x, Mapping) else module(x)


def refuse_example_mixing(module: nn.Module, x: torch.Tensor) -> None:
    """Raise :class:`~veil.errors.ModelNotSupportedError` if ``module``'s forward lets one example
    move another's output, or updates float buffers, probed on ``x``: at least 4 PUBLIC inputs (never
    private rows: :func:`veil.pipeline.public_inputs.synthetic_inputs`), so the verdict depends on
    no record.

    For a whole model before any of its parts is used on its own (e.g. a fixed front whose features
    are precomputed, which ``make_private`` on the head alone would never see)."""
    from torch.utils.data import TensorDataset

    probe = probe_forward(module, DataLoader(TensorDataset(torch.as_tensor(x[:4]))))
    if isinstance(probe, Problem):
        raise ModelNotSupportedError([probe])


_PROBE_ITEMS = 4
#: The public sequence lengths a 1-D integer leaf (token ids, their masks) is probed at: never the
#: length of a dataset item, which for variable-length text is a private value.
_SEQUENCE_LENGTHS = (8, 32)
#: Public stand-ins for string leaves (raw text a loader's ``collate_fn`` tokenizes), of varied length.
_PUBLIC_TEXTS = ("a", "the probe", "one more public text", "veil checks that examples do not mix here")


@dataclass(frozen=True)
class _Draw:
    """How one set of synthetic items is drawn: floats from ``floats`` (``normal`` N(0, 1), ``unit``
    U[0, 1], ``pixel`` U[0, 255]); integers uniform below ``int_high`` (a mask all ones, a label 0 or
    1); 1-D integer leaves of length ``length`` (None: the template's shape)."""

    floats: str
    int_high: int
    length: int | None


def _is_label(key: str) -> bool:
    return key.endswith(("label", "labels"))


def _floats(shape: tuple[int, ...], draw: _Draw, generator: torch.Generator) -> torch.Tensor:
    if draw.floats == "normal":
        return torch.randn(shape, generator=generator, dtype=torch.float64)
    scale = 255.0 if draw.floats == "pixel" else 1.0
    return torch.rand(shape, generator=generator, dtype=torch.float64) * scale


def _integers(shape: tuple[int, ...], key: str, draw: _Draw, generator: torch.Generator) -> torch.Tensor:
    if key.endswith("mask"):
        return torch.ones(shape, dtype=torch.int64)
    high = 2 if _is_label(key) else draw.int_high
    return torch.randint(0, high, shape, generator=generator)


def _synthetic_like(value: Any, generator: torch.Generator, draw: _Draw, key: str = "") -> Any:
    """A random value with ``value``'s structure and dtypes, none of its values (tensors, arrays,
    Python numbers and lists of them alike), drawn as ``draw`` says; shapes are ``value``'s except
    that a 1-D integer leaf (a token sequence) takes ``draw.length``. Strings get a public text
    (:data:`_PUBLIC_TEXTS`); other leaves None (no public stand-in for them)."""
    if isinstance(value, Mapping):
        return {k: _synthetic_like(v, generator, draw, str(k)) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_synthetic_like(v, generator, draw, key) for v in value)
    if isinstance(value, list):
        if draw.length is not None and value and all(type(v) is int for v in value):
            return _integers((draw.length,), key, draw, generator).tolist()
        return [_synthetic_like(v, generator, draw, key) for v in value]
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor):
        shape, dtype = tuple(value.shape), value.dtype
        if dtype.is_floating_point or dtype.is_complex:
            return _floats(shape, draw, generator).to(dtype)
        if dtype == torch.bool:
            return torch.rand(shape, generator=generator) < 0.5
        if len(shape) == 1 and draw.length is not None:
            shape = (draw.length,)
        return _integers(shape, key, draw, generator).to(dtype)
    if isinstance(value, bool):
        return bool(torch.rand((), generator=generator) < 0.5)
    if isinstance(value, int):
        return int(_integers((), key, draw, generator))
    if isinstance(value, float):
        return float(_floats((), draw, generator))
    if isinstance(value, str):
        return _PUBLIC_TEXTS[int(torch.randint(0, len(_PUBLIC_TEXTS), (), generator=generator))]
    return None


def _leaves_ok(value: Any) -> bool:
    if isinstance(value, Mapping):
        return all(_leaves_ok(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_leaves_ok(v) for v in value)
    return value is not None


def _has_sequence(value: Any) -> bool:
    """Whether ``value`` holds a 1-D integer leaf (a tensor, or a list of Python ints)."""
    if isinstance(value, Mapping):
        return any(_has_sequence(v) for v in value.values())
    if isinstance(value, tuple):
        return any(_has_sequence(v) for v in value)
    if isinstance(value, list):
        return (bool(value) and all(type(v) is int for v in value)) or any(_has_sequence(v) for v in value)
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and np.issubdtype(value.dtype, np.integer)
    return isinstance(value, torch.Tensor) and value.dim() == 1 and not value.dtype.is_floating_point


def _has_float(value: Any) -> bool:
    """Whether ``value`` holds a floating-point leaf (a tensor, an array or a Python float)."""
    if isinstance(value, Mapping):
        return any(_has_float(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_float(v) for v in value)
    if isinstance(value, np.ndarray):
        return bool(np.issubdtype(value.dtype, np.floating))
    if isinstance(value, torch.Tensor):
        return value.dtype.is_floating_point or value.dtype.is_complex
    return isinstance(value, float)


def public_loaders(loader: DataLoader, module: nn.Module, template: Any = None) -> list[DataLoader] | str:
    """Probe loaders of :data:`_PROBE_ITEMS` synthetic items each, built like ``loader``'s dataset items
    (with its ``collate_fn``), or a string saying why none can be made.

    The engine knows nothing public about a user's data but its items' structure and dtypes, and the
    shapes of fixed-shape items (images, table rows): those are taken as public (read from the first
    item), its values never are. A 1-D integer leaf (token ids: a variable length is a private value)
    is probed at the public lengths :data:`_SEQUENCE_LENGTHS` instead of its own; integers are drawn
    below the model's smallest embedding table (its architecture is public), floats from three public
    distributions (a forward that mixes only on inputs of one range is still probed there); strings
    get public texts. Every draw comes from a fixed seed, so the verdict is a function of the model,
    the items' structure and these public choices.

    ``template``: an item built from the dataset's structure alone (with a public population the
    dataset's size is private and may be 0 or 1: :func:`veil.engine.wrapping.template_item`). Given,
    the probe never looks at the dataset's length or rows, so its verdict is the same for every
    private size; without it the first item is read and a dataset of fewer than 2 items is skipped
    (its size is then public)."""
    if template is None:
        dataset = loader.dataset
        try:
            n = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            return "skipped: the dataset has no length"
        if n < 2:
            return "skipped: fewer than 2 examples"
        template = dataset[0]
    tables = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    int_high = max(2, min(tables)) if tables else 2
    lengths: tuple[int | None, ...] = _SEQUENCE_LENGTHS if _has_sequence(template) else (None,)
    ranges = ("normal", "unit", "pixel") if _has_float(template) else ("normal",)  # else the same draws
    loaders: list[DataLoader] = []
    for length in lengths:
        for floats in ranges:
            draw = _Draw(floats, int_high, length)
            generator = torch.Generator().manual_seed(0)
            items = [_synthetic_like(template, generator, draw) for _ in range(_PROBE_ITEMS)]
            if not all(_leaves_ok(item) for item in items):
                return "skipped: the dataset's items hold values with no public stand-in"
            loaders.append(DataLoader(items, collate_fn=loader.collate_fn))  # type: ignore[arg-type]
    return loaders


def _without_dropout() -> Any:
    """A torch-function mode under which dropout is the identity (``F.dropout`` and its variants,
    and ``scaled_dot_product_attention``'s ``dropout_p``): dropout acts on each element alone, so it
    never mixes examples, but its masks are not replayed exactly by fused kernels (attention); the
    probe compares training-mode forwards without it."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    dropouts = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
    attention = F.scaled_dot_product_attention

    class NoDropout(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            kwargs = dict(kwargs or {})
            if func in dropouts:
                return args[0] if args else kwargs["input"]
            if func is attention:
                if len(args) > 4:
                    args = (*args[:4], 0.0, *args[5:])
                else:
                    kwargs["dropout_p"] = 0.0
            return func(*args, **kwargs)

    return NoDropout()


def _shapes(x: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in _tensors(x)]


def _variants(
    items: list[Any], spare: Any, base: Any, loader: DataLoader, device: torch.device, dtype: Any
) -> list[tuple[set[int], list[Any]]]:
    """The probe's changed batches, each with the positions it changed: the first and then the last
    item replaced (by the next dataset item, else by another item of the batch). The forward's other
    randomness is replayed from one RNG state, which agrees only between inputs of the same shape: a
    replacement that changes the collated shape (a text of another
    length padded differently) is replaced by a swap of the first and last items, which keeps every
    shape and still changes an example (the middle one is then compared)."""
    k = len(items)
    variants = [
        ({0}, [spare if spare is not None else items[-1], *items[1:]]),
        ({k - 1}, [*items[:-1], spare if spare is not None else items[0]]),
    ]
    if k < 3:
        return variants
    out = []
    for changed, batch in variants:
        if _shapes(_model_input(loader.collate_fn(batch), device, dtype)) != _shapes(base):
            changed, batch = {0, k - 1}, [items[-1], *items[1:-1], items[0]]
        out.append((changed, batch))
    return out


def probe_forward(module: nn.Module, loader: DataLoader) -> Problem | str:
    """Does one example influence the other examples' outputs? Does a forward update float buffers?

    Runs the model in training mode (the mode it trains in: a module that mixes examples only
    while ``self.training``, as BatchNorm does, is found even when handed over in eval mode; every
    submodule's own mode is restored afterwards) with dropout off (:func:`_without_dropout`), under
    ``no_grad``, from the same RNG state each time, buffers restored afterwards, on a batch of ≤ 3
    of ``loader``'s items (public inputs only: the caller's duty, see the module's docstring), then
    on the same batch with the first and with the last item replaced (inputs of the same shapes:
    :func:`_variants`), and compares the outputs of the unchanged examples. A batch
    that is a dict of tensors (a Hugging Face batch) is passed as keywords. Returns a
    :class:`Problem` if they move (or a floating-point buffer changed), else a string saying it
    passed or why it was skipped (fewer than 2 examples, no tensor input first in the batch, a
    forward that needs more than the first batch field).
    """
    dataset = loader.dataset
    n = len(dataset)  # type: ignore[arg-type]
    if n < 2:
        return "skipped: fewer than 2 examples"
    k = min(3, n)
    items = [dataset[i] for i in range(k)]
    spare = dataset[k] if n > k else None
    param = next(iter(module.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else None
    try:
        base = _model_input(loader.collate_fn(items), device, dtype)
        changed_inputs = [
            (changed, _model_input(loader.collate_fn(batch), device, dtype))
            for changed, batch in _variants(items, spare, base, loader, device, dtype)
        ]
    except Exception as exc:  # best effort: static validation already ran
        return f"skipped: could not collate a probe batch ({type(exc).__name__})"
    if base is None or _rows(base) != (k,) or any(x is None for _, x in changed_inputs):
        return "skipped: the batch has no tensor input with the batch dimension first"
    saved = {name: b.detach().clone() for name, b in module.named_buffers()}
    modes = [(m, m.training) for m in module.modules()]
    devices = [device] if device.type == "cuda" else []
    try:
        module.train()
        with torch.random.fork_rng(devices=devices), torch.no_grad(), _without_dropout():
            cpu_state = torch.get_rng_state()
            cuda_state = torch.cuda.get_rng_state(device) if devices else None

            def outputs(x: Any) -> list[torch.Tensor]:
                torch.set_rng_state(cpu_state)
                if cuda_state is not None:
                    torch.cuda.set_rng_state(cuda_state, device)
                return [t.double() for t in _tensors(_call(module, x)) if t.shape[:1] == (k,)]

            reference = outputs(base)
            moved = [
                name
                for name, b in module.named_buffers()
                if b.is_floating_point() and name in saved and not torch.equal(b, saved[name])
            ]
            others = [(j, outputs(x)) for j, x in changed_inputs if x is not None]
    except Exception as exc:
        return f"skipped: the forward needs more than the first batch field ({type(exc).__name__})"
    finally:
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in saved:
                    b.copy_(saved[name])
    if moved:
        return Problem(
            ", ".join(moved),
            "a training-mode forward updates these buffers from private data without noise",
            "stop updating buffers from data in forward (or register them as constants)",
        )
    if not reference:
        return "skipped: no output with the batch dimension first"
    for changed, outs in others:
        keep = [i for i in range(k) if i not in changed]
        for a, b in zip(reference, outs, strict=False):
            a, b = a[keep], b[keep]
            scale = max(1.0, float(a.abs().max())) if a.numel() else 1.0
            if not torch.allclose(a, b, rtol=1e-4, atol=1e-6 * scale, equal_nan=True):
                return Problem(
                    "forward",
                    "changing one example changed the outputs of other examples in the batch: the forward "
                    "mixes examples (batch statistics, x.mean(0), attention across the batch dimension), "
                    "so one example's influence is not bounded by clipping its own gradient",
                    "compute every example's output from that example alone (e.g. GroupNorm instead of "
                    "BatchNorm, no reductions over the batch dimension)",
                )
    return "passed"
