"""What a config key may hold, written beside the key: `Annotated[int, Spec(low=1, doc="...")]`
on a schema field (config/schema.py) or on a component's argument (a model factory, a data
loader, an init scheme), and one checker for all of them. Torch-free, so that a config error
answers without importing it.

Why not OmegaConf's structured merge (Hydra's ConfigStore)? It would turn choice fields into Enum
members inside the config the code, W&B and checkpoints read, it rejects Literal, and its errors
span several lines; this checker leaves the config as composed and says what is wrong in one line
(the key, the value, what would work).
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, ListConfig

from halfprec.errors import ConfigError


@dataclass(frozen=True)
class Spec:
    """Bounds and meaning of a key, beyond its type. Bounds are inclusive (`low`, `high`) or
    exclusive (`above`, `below`); for a list they apply to each element."""

    doc: str = ""
    low: float | None = None
    high: float | None = None
    above: float | None = None
    below: float | None = None
    nonempty: bool = False  # a list with at least one element, a string with at least one character


@dataclass
class Choice:
    """A registered component chosen by name (model.arch, data.name, init.scheme, task.name) with
    its factory's keyword arguments, the group's other keys, as the config has them once
    config/validate.py has checked them against the factory's annotations."""

    name: str
    args: dict[str, Any]


def flat_keys(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as its dotted keys (`precision.recipe.hadamard`) and their values; an empty
    mapping has no key."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_node(
    node: DictConfig,
    schema: type | Callable,
    prefix: str,
    owner: str,
    extra: Iterable[str] = (),
    hidden: Iterable[str] = (),
) -> None:
    """Every key of `node` is one `schema` (a dataclass, or a function's arguments but the `hidden`
    ones, which the code passes itself) declares, or one of `extra` (checked elsewhere), and holds
    what its annotation allows. Raise ConfigError on the first that does not."""
    # a class other than a dataclass (a task) is described by its constructor's arguments
    described = _constructor(schema) if isinstance(schema, type) and not is_dataclass(schema) else schema
    hints = get_type_hints(described, include_extras=True)
    if is_dataclass(schema):
        declared = [f.name for f in fields(schema)]
    else:
        declared = [n for n in inspect.signature(schema).parameters if n not in set(hidden)]
    if not isinstance(node, DictConfig):  # `group=value` where the group's keys were meant
        raise ConfigError(prefix, node, f"a mapping of {', '.join(declared)}: set one as {prefix}.{declared[0]}=...")
    known_keys(node, prefix, [*extra, *declared], owner)
    for key in node:
        if key in hints and key in declared:
            check_value(f"{prefix}.{key}" if prefix else key, node[key], hints[key])


def _constructor(cls: type[Any]) -> Callable:
    # read from type[Any]: mypy rejects `__init__` on a plain `type` value (a subclass may differ)
    return cls.__init__


def known_keys(node: DictConfig, prefix: str, allowed: list[str], owner: str) -> None:
    """`+key=value` adds any key: catch those instead of ignoring them, with the closest name."""
    for key in node:
        if key not in allowed:
            text = str(key)  # a DictConfig key may be typed int, bytes or Enum; a composed config's are str
            close = difflib.get_close_matches(text, allowed, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            full = f"{prefix}.{text}" if prefix else text
            takes = f"it takes: {', '.join(allowed)}" if allowed else "it takes no keys"
            raise ConfigError(full, node[key], f"unknown key for {owner}; {hint}{takes}")


def check_value(key: str, value: Any, hint: Any) -> None:
    kind, spec = unwrap(hint)
    if not fits(value, kind, spec):
        raise ConfigError(key, value, describe(kind, spec))


def unwrap(hint: Any) -> tuple[Any, Spec]:
    if get_origin(hint) is Annotated:
        kind, *extras = get_args(hint)
        return kind, next((e for e in extras if isinstance(e, Spec)), Spec())
    return hint, Spec()


# annotations a config list fits: `list[int]`, `tuple[int, ...]`, `Sequence[int]` (whose origin is
# collections.abc.Sequence, for typing's alias too)
SEQUENCES = (list, tuple, Sequence, typing.Sequence)


def fits(value: Any, kind: Any, spec: Spec) -> bool:
    origin = get_origin(kind)
    if origin in (Union, types.UnionType):
        return any(fits(value, member, spec) for member in get_args(kind))
    if origin is Literal:  # by type too: 1 is not True, 0.0 not False
        return any(type(value) is type(choice) and value == choice for choice in get_args(kind))
    if origin in SEQUENCES or kind in SEQUENCES:
        items = get_args(kind)[:1] or (Any,)
        is_list = isinstance(value, (ListConfig, list, tuple))
        return is_list and (len(value) > 0 or not spec.nonempty) and all(fits(v, items[0], spec) for v in value)
    if kind is type(None) or kind is None:
        return value is None
    if kind is Any:
        return True
    if kind is bool:
        return isinstance(value, bool)
    if kind in (int, float):
        number = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
        return number and within(value, spec)
    if kind is str:
        return isinstance(value, str) and (value != "" or not spec.nonempty)
    return isinstance(value, kind)


def within(value: float, spec: Spec) -> bool:
    return (
        (spec.low is None or value >= spec.low)
        and (spec.high is None or value <= spec.high)
        and (spec.above is None or value > spec.above)
        and (spec.below is None or value < spec.below)
    )


def describe(kind: Any, spec: Spec) -> str:
    """'must be ...': what the annotation and the spec allow, and what the key means."""
    allowed = members(kind)
    names = list(dict.fromkeys(name(member, spec) for member in allowed))
    values = all(
        not isinstance(m, type) and m is not None and get_origin(m) is None for m in allowed if m is not type(None)
    )
    text = "must be " + (f"one of {', '.join(names)}" if values and len(names) > 2 else " or ".join(names))
    return text + (f" ({spec.doc})" if spec.doc else "")


def members(kind: Any) -> list[Any]:
    if get_origin(kind) in (Union, types.UnionType):
        return [m for member in get_args(kind) for m in members(member)]
    if get_origin(kind) is Literal:
        return list(get_args(kind))
    return [kind]


def name(kind: Any, spec: Spec) -> str:
    """One allowed kind of value, as a user would say it: `an integer >= 1`, `null`, `auto`."""
    if kind is type(None) or kind is None:
        return "null"
    if isinstance(kind, bool):  # a Literal member
        return str(kind).lower()
    if kind is bool:
        return "true or false"
    if kind in (int, float):
        return ("an integer" if kind is int else "a number") + bounds(spec)
    if kind is str:
        return "a non-empty string" if spec.nonempty else "a string"
    if get_origin(kind) in SEQUENCES or kind in SEQUENCES:
        item = (get_args(kind)[:1] or (Any,))[0]
        noun = {int: "integers", float: "numbers", str: "strings"}.get(item, "values")
        if get_origin(item) is Literal:  # the values it takes: forward, dgrad or wgrad
            *some, last = map(str, get_args(item))
            noun = f"{', '.join(some)} or {last}" if some else last
        return f"a {'non-empty ' if spec.nonempty else ''}list of {noun}{bounds(spec)}"
    return str(kind) if isinstance(kind, str) else getattr(kind, "__name__", str(kind))


def bounds(spec: Spec) -> str:
    limits = ((">=", spec.low), (">", spec.above), ("<=", spec.high), ("<", spec.below))
    return "".join(f" {op} {bound:g}" if i == 0 else f" and {op} {bound:g}"
                   for i, (op, bound) in enumerate((op, b) for op, b in limits if b is not None))  # fmt: skip
