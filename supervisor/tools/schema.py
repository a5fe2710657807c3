"""JSON Schema checks of outside tools, with ``jsonschema`` (the reference
implementation): a schema is checked once against its metaschema (the
``$schema`` it names, Draft 2020-12 when it names none) and compiled
validators are cached by the schema's canonical text.

Why ``jsonschema`` and not ``fastjsonschema``: the schemas come from MCP
servers others wrote, so they are untrusted input; fastjsonschema compiles
each schema to Python source and ``exec``s it, and supports drafts 4-7 only,
while MCP servers publish 2020-12 schemas. jsonschema interprets the schema,
covers every draft, checks the schema itself (``check_schema``), and its
``best_match`` error names the failing path, which is what the model needs to
fix its call. It resolves no remote ``$ref`` (no network at call time).

Invariants:
- ``check_schema`` and ``validate`` never raise anything but ``SchemaProblem``
  / ``ArgumentsInvalid`` for bad input (a schema that is not a map, a broken
  ``$ref``, an over-deep schema): a server's bad schema cannot crash the caller.
- Messages are bounded (``MAX_MESSAGE_CHARS``).
- The cache is bounded (``CACHE_SIZE``, least recently used out).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

# jsonschema (with referencing, attrs, rpds) is imported at the first schema
# check, not with this module: the supervisor's config imports this module, and
# the import cost 26% of the supervisor's start-up CPU for farms that have no
# outside tool at all.

CACHE_SIZE: Final = 256
MAX_SCHEMA_BYTES: Final = 256 * 1024
MAX_MESSAGE_CHARS: Final = 1000


class SchemaProblem(ValueError):
    """A schema that is not a valid JSON Schema."""


class ArgumentsInvalid(ValueError):
    """Arguments that do not match their tool's schema; the message says where."""


_cache: OrderedDict[str, Validator] = OrderedDict()


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def _validator(schema: Any) -> Validator:
    if not isinstance(schema, dict):
        raise SchemaProblem("a schema must be a JSON object")
    try:
        key = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise SchemaProblem(f"the schema is not JSON: {exc}") from None
    if len(key) > MAX_SCHEMA_BYTES:
        raise SchemaProblem(f"the schema is {len(key)} bytes; at most {MAX_SCHEMA_BYTES}")
    found = _cache.get(key)
    if found is not None:
        _cache.move_to_end(key)
        return found
    import jsonschema
    from jsonschema import exceptions as js_exceptions
    from referencing import Registry

    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        # An empty registry: a remote $ref is unresolvable, never fetched.
        validator: Validator = cls(schema, registry=Registry())
    except js_exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise SchemaProblem(_clip(f"at {where}: {exc.message}")) from None
    except (RecursionError, ValueError, TypeError, LookupError) as exc:
        raise SchemaProblem(_clip(f"unusable schema: {exc}")) from None
    _cache[key] = validator
    if len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return validator


def check_schema(schema: Any) -> None:
    """Raise ``SchemaProblem`` unless ``schema`` is a valid JSON Schema."""
    _validator(schema)


def validate(schema: Any, arguments: Any) -> None:
    """Raise ``ArgumentsInvalid`` (or ``SchemaProblem``) unless ``arguments``
    match ``schema``."""
    from jsonschema import exceptions as js_exceptions

    validator = _validator(schema)
    try:
        error = js_exceptions.best_match(validator.iter_errors(arguments))
    except Exception as exc:  # untrusted schema: any failure is its fault
        # e.g. an unresolvable $ref, found only while validating
        raise SchemaProblem(_clip(f"the schema cannot be applied: {exc}")) from None
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise ArgumentsInvalid(_clip(f"arguments do not match the tool's schema at {where}: "
                                     f"{error.message}"))
