"""A command's own flags from a dataclass: one flag per field, in order, each with its
own help in the field's metadata.

``deploy/flags.py`` makes a config's flags, every one helped by its default; a
command's options (what to run, where to write) say more, so each field's metadata
holds its ``help`` and any other keyword of ``add_argument`` (``metavar``, ``nargs``,
``const``). A field holding a dataclass of its own makes its fields a group of flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any


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
