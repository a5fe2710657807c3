"""What the engine hands the store is storable: within the store's bounds and
valid UTF-8, whatever the model, a hook or a worker produced.

The model's output, hook contexts, tool outputs and error texts can be of any
size and may hold lone surrogates (a JSON ``"\\ud800"`` escape decodes to one).
The store refuses a value over its bound (``RecordTooLarge``), which would
fail the turn, so ``Session.commit`` passes every transcript item, rewrite and
event payload through ``fit_items`` / ``fit_value`` first. Tool-call arguments
are executed, so they are never cut: ``check_calls`` refuses a call whose
arguments are too large (or not a finite JSON object) with a typed reason,
before anything of it is stored.

Policy (the same for every path, see docs/storage.md "Bounds and encoding"):
- A lone surrogate in a string from the model or a hook is replaced with
  U+FFFD, here, before the value is stored, published or sent on. Memory,
  store and subscribers therefore see the same text.
- A value over its bound has its largest strings cut, each keeping its head
  and ending with a visible marker (``CUT_MARKER``), until it fits. The sizes
  are measured with the store's own encoder (``sandbox_worker.api.json_text``).
- A batch over its bound has its largest items cut the same way.

Invariants:
- ``fit_value(v, n)`` returns ``v`` itself (no copy) when it is within ``n``
  and clean; otherwise a copy. The caller's value is never mutated.
- Only a value that cannot be made to fit (its strings are already down to
  their markers) is passed on unchanged; the store then refuses it.
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

from broker.protocol import scrub_surrogates
from sandbox_worker.api import MAX_CALL_ID_CHARS, fit_text, json_text

CUT_MARKER: Final = ("\n[... cut by Corral to fit the store's bound: {shown} of {total} "
                     "bytes kept]")
_MAX_ROUNDS: Final = 64
# Tool calls: one model step's calls and their arguments live in the checkpoint
# state row until they are done (docs/storage.md); these keep it bounded.
MAX_CALLS_PER_STEP: Final = 128
MAX_NAME_CHARS: Final = 256
_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _measure(value: Any) -> tuple[int, bool]:
    """(bytes as stored, whether every string is valid UTF-8 text)."""
    text = _ENCODER.encode(value)
    try:
        return len(text.encode("utf-8")), True
    except UnicodeEncodeError:
        return json_text(value)[1], False


def _strings(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[int, tuple[Any, ...]]]:
    """(body size, path) of every string value inside ``value``."""
    if isinstance(value, str):
        return [(json_text(value)[1] - 2, path)]
    out: list[tuple[int, tuple[Any, ...]]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.extend(_strings(v, (*path, k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(_strings(v, (*path, i)))
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_copy(v) for v in value]
    return value


def _set(value: Any, path: tuple[Any, ...], new: str) -> Any:
    if not path:
        return new
    target = value
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = new
    return value


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


def fit_value(value: Any, limit: int) -> Any:
    """``value`` made storable within ``limit`` bytes (see the module docstring)."""
    try:
        size, clean = _measure(value)
    except (ValueError, TypeError, RecursionError):
        return value  # not JSON at all: the store refuses it with its own message
    if clean and size <= limit:
        return value
    value = scrub_surrogates(value) if not clean else _copy(value)
    if not clean:
        size = _measure(value)[0]
    floor = len(CUT_MARKER) + 32
    for _ in range(_MAX_ROUNDS):
        if size <= limit:
            break
        strings = _strings(value)
        if not strings:
            break
        body, path = max(strings, key=lambda s: s[0])
        if body <= floor:
            break
        target = max(floor, body - (size - limit))
        cut, _ = fit_text(_get(value, path), target + 2, CUT_MARKER)
        value = _set(value, path, cut)
        size = _measure(value)[0]
    return value


def fit_items(items: list[dict[str, Any]], item_limit: int,
              total_limit: int) -> list[dict[str, Any]]:
    """Each item within ``item_limit``, all of them within ``total_limit``."""
    try:
        measured = [_measure(i) for i in items]
    except (ValueError, TypeError, RecursionError):
        return items  # not JSON at all: the store refuses it with its own message
    if all(clean and size <= item_limit for size, clean in measured) and \
            sum(size for size, _ in measured) + len(items) + 1 <= total_limit:
        return items  # the common case: one encoding per item
    fitted = [fit_value(i, item_limit) for i in items]
    sizes = [_measure(i)[0] for i in fitted]
    for _ in range(_MAX_ROUNDS):
        total = sum(sizes) + len(sizes) + 1  # commas and brackets
        if total <= total_limit:
            break
        at = max(range(len(sizes)), key=sizes.__getitem__)
        smaller = fit_value(fitted[at], max(1024, sizes[at] - (total - total_limit)))
        new_size = _measure(smaller)[0]
        if new_size >= sizes[at]:
            break
        fitted[at], sizes[at] = smaller, new_size
    changed = any(a is not b for a, b in zip(fitted, items, strict=True))
    return fitted if changed else items


# ---------------------------------------------------------------------------
# Tool-call arguments from the model
# ---------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def parse_arguments(raw: Any) -> tuple[dict[str, Any] | None, str | None, bool]:
    """The model's arguments as an object, or why they are not one, and
    whether lone surrogates were replaced in them.

    Strict JSON: NaN/Infinity and numbers out of range are refused (the store
    refuses them too); nesting too deep for the parser is refused; a lone
    surrogate in a string becomes U+FFFD."""
    if isinstance(raw, dict):
        value: Any = raw
    elif not isinstance(raw, str):
        return None, "arguments must be a JSON object", False
    else:
        try:
            value = json.loads(raw or "{}", parse_constant=_no_constant, parse_float=_finite)
        except RecursionError:
            return None, "arguments are nested too deeply", False
        except ValueError as exc:
            return None, f"arguments are not valid JSON: {str(exc)[:200]}", False
    if not isinstance(value, dict):
        return None, "arguments must be a JSON object", False
    try:
        _, clean = _measure(value)
    except (ValueError, TypeError, RecursionError):
        return None, "arguments must be a finite JSON object", False
    return (value, None, False) if clean else (scrub_surrogates(value), None, True)


def clean_id(raw: Any, limit: int = MAX_CALL_ID_CHARS) -> str | None:
    """A model-given id or name usable as is: a string of 1..limit characters
    without lone surrogates; otherwise None (the caller picks a fresh one)."""
    if not isinstance(raw, str) or not raw or len(raw) > limit:
        return None
    return raw if _measure(raw)[1] else None
