"""Command-line flags from config dataclasses: one flag per field, defaults from the class.

A field that holds a config of its own (``GatewayConfig.routing``, a ``PolicyConfig``)
contributes its fields' flags under the same prefix, so ``prefix-router gateway
--stride 8 --recompute-weight 2`` reaches the nested fields; two fields with one
flag name are refused by argparse when the parser is built. A field whose metadata
says ``{"flag": False}`` gets no flag.

A command's own options (what to run, where to write) say more than their default:
:func:`add_option_flags` takes each flag's ``help`` and any other keyword of
``add_argument`` (``metavar``, ``nargs``, ``const``) from its field's metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
import shlex
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
SCALARS = (int, float, str, bool)
#: A dataclass field's line: its name and annotation.
FIELD_LINE = re.compile(r"(\w+)\s*:\s*\S")


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str = "",
    skip: Sequence[str] = (),
    env_prefix: str | None = None,
) -> None:
    """One ``--prefix-name`` flag per scalar field of dataclass ``cls`` (nested included).

    Flags default to ``None`` (their help shows the dataclass default), so
    :func:`config_overrides` returns exactly what the user gave. With ``env_prefix``
    (for Locust's configargparse parser) each flag also reads ``ENV_PREFIX_NAME``.
    """
    group = parser.add_argument_group(f"{cls.__name__} ({prefix.rstrip('-') or 'options'})")
    for field, default, kind, owner in _scalar_fields(cls, skip):
        doc = field_docs(owner).get(field.name)
        flag = f"--{prefix}{field.name.replace('_', '-')}"
        dest = _dest(prefix, field.name)
        extra: dict[str, Any] = {}
        if env_prefix is not None:
            extra["env_var"] = f"{env_prefix}{field.name}".upper()
        if kind is bool:
            action: Any = argparse.BooleanOptionalAction
            text = _escaped(doc) if doc else None
            group.add_argument(flag, dest=dest, action=action, default=None, help=text, **extra)
        elif kind is tuple:
            text = f"{_escaped(doc)} (repeatable)" if doc else "repeatable"
            metavar = field.metadata.get("metavar", "VALUE")
            group.add_argument(flag, dest=dest, action="append", metavar=metavar, help=text)
        else:
            shown = (
                default
                if default not in (None, "") and "derived" not in field.metadata
                else _default_text(field)
            )
            text = f"{_escaped(doc)} (default: {shown})" if doc else f"default: {shown}"
            metavar = kind.__name__.upper()
            group.add_argument(flag, dest=dest, type=kind, metavar=metavar, help=text, **extra)


def config_overrides(args: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The fields of ``cls`` that the user set; a nested config's come as a dict of their own."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        nested = _nested_type(field)
        if nested is not None:
            inner = config_overrides(args, nested, prefix)
            if inner:
                values[field.name] = inner
            continue
        value = getattr(args, _dest(prefix, field.name), None)
        if value is not None:
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return values


def with_overrides(config: T, overrides: Mapping[str, Any]) -> T:
    """``config`` with ``overrides`` applied (a dict for a nested config applies to it)."""
    changes = {
        name: with_overrides(getattr(config, name), value) if isinstance(value, Mapping) else value
        for name, value in overrides.items()
    }
    return dataclasses.replace(config, **changes)  # type: ignore[type-var]


def config_from_args(cls: type[T], args: argparse.Namespace, prefix: str = "", **fixed: Any) -> T:
    """``cls`` from its defaults, then ``fixed``, then what the user set; checked by the class."""
    return with_overrides(cls(**fixed), config_overrides(args, cls, prefix))


def config_flags(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The command-line flags that :func:`add_config_flags` reads back as ``values``."""
    flags = []
    for name, value in values.items():
        if isinstance(value, Mapping):
            flags += config_flags(value, prefix)
            continue
        flag = f"--{prefix}{name.replace('_', '-')}"
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, tuple | list):
            flags += [word for item in value for word in (flag, str(item))]
        else:
            flags += [flag, str(value)]
    return flags


def _scalar_fields(
    cls: type, skip: Sequence[str]
) -> Iterator[tuple[dataclasses.Field, Any, type, type]]:
    """Each field that takes a flag, with its default and type, nested configs' fields
    in place. A field that defaults to ``None`` (``int | None``: "derived unless given")
    takes a flag of its other type."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip or not field.metadata.get("flag", True):
            continue
        nested = _nested_type(field)
        if nested is not None:
            yield from _scalar_fields(nested, skip)
        elif isinstance(field.default, (*SCALARS, tuple)):  # a tuple: a repeatable flag
            yield field, field.default, type(field.default), cls
        elif field.default is None:
            kinds = [k for k in typing.get_args(hints[field.name]) if k in SCALARS]
            if len(kinds) == 1:
                yield field, None, kinds[0], cls


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's ``#:`` comment in the class's source (the lines right above it),
    as one line: a config's flags say what the field says (``{}`` where the source
    cannot be read)."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    comment: list[str] = []
    for line in lines[1:]:
        text = line.strip()
        field = FIELD_LINE.match(text)
        if text.startswith("#:"):
            comment.append(text[2:].strip())
            continue
        if field is not None and comment:
            docs[field.group(1)] = " ".join(comment)
        comment = []
    return docs


def _escaped(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


def _default_text(field: dataclasses.Field) -> str:
    return str(field.metadata.get("derived", "derived"))


def _nested_type(field: dataclasses.Field) -> type | None:
    """The config class a field holds, if it holds one (built by its default factory)."""
    if field.default_factory is dataclasses.MISSING:
        return None
    default = field.default_factory()
    return type(default) if dataclasses.is_dataclass(default) else None


def _dest(prefix: str, name: str) -> str:
    return f"{prefix}{name}".replace("-", "_")


def add_engine_flags(parser: argparse.ArgumentParser, engines: Mapping[str, str]) -> None:
    """Which engine the replicas run (``engines``: each kind's name and what it is, the
    first the default), and vLLM's own flags."""
    parser.add_argument(
        "--engine",
        choices=list(engines),
        default=next(iter(engines)),
        help="; ".join(f"{name}: {summary}" for name, summary in engines.items()),
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="FLAGS",
        help="repeatable; vLLM's own flags, as vLLM names them, after ours so they win: "
        "--engine-arg=--max-num-seqs=64, or --engine-arg='--kv-cache-memory-bytes 64M'",
    )
    parser.add_argument(
        "--vllm-dev-mode",
        action="store_true",
        help="run vLLM servers with VLLM_SERVER_DEV_MODE=1, for its /reset_prefix_cache "
        "(bench empties caches with it between runs); it opens vLLM's other development "
        "endpoints too, so it is off unless asked (bench's own deployment asks)",
    )


def shell_words(values: Sequence[str]) -> tuple[str, ...]:
    """A repeatable flag's values (``--engine-arg='--a 1' --engine-arg=--b``), each
    split as a shell splits words."""
    return tuple(word for text in values for word in shlex.split(text))


def engine_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The ``--engine-arg`` values, as words."""
    return shell_words(args.engine_arg)


def helped(text: str, **keywords: Any) -> dict[str, Any]:
    """An option field's metadata: its flag's ``help`` and other ``add_argument``
    keywords (``metavar``, ``nargs``, ``const``)."""
    return {"help": text, **keywords}


def add_option_flags(parser: argparse.ArgumentParser | Any, cls: type) -> None:
    """One ``--name`` flag per field of dataclass ``cls``: its default the field's, its
    type the default's (``X | None``: ``X``), ``store_true`` where it defaults to
    False, repeatable where it defaults to a tuple. A nested dataclass's fields go in
    a group, its metadata's ``title`` and ``description``."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.default_factory is not dataclasses.MISSING:
            meta = field.metadata
            group = parser.add_argument_group(meta["title"], meta.get("description"))
            add_option_flags(group, hints[field.name])
            continue
        flag = f"--{field.name.replace('_', '-')}"
        parser.add_argument(flag, **_keywords(field, hints[field.name]), **field.metadata)


def _keywords(field: dataclasses.Field, hint: Any) -> dict[str, Any]:
    if field.default is False:
        return {"action": "store_true"}
    if isinstance(field.default, tuple):  # repeatable: each use adds one
        return {"action": "append", "default": list(field.default)}
    kinds = [kind for kind in typing.get_args(hint) if kind is not type(None)] or [hint]
    return {"type": kinds[0], "default": field.default}
