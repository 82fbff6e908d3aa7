"""One table per config object: the flags that set its fields, read both ways.

A `FlagTable` lists, for each field of a config dataclass, the command-line flag that sets it and
that flag's argparse options. From the one table come the parser flags (`add`), the config from
parsed flags (`from_args`) and the flags that give another process the same config
(`to_flags`), so a field, its flag name, its default and its help text are written once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Generic, TypeVar

C = TypeVar("C")


@dataclass(frozen=True, slots=True)
class Flag:
    """The flag ``name`` (default: ``--field-name``, from the field's name) sets the config's
    ``field``; ``options`` are `add_argument`'s keyword arguments.

    ``forward=False``: `to_flags` leaves it out (a secret that travels in the environment, or a
    value the config holds in a form no flag can carry)."""

    field: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    name: str = ""
    forward: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", "--" + self.field.replace("_", "-"))

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


def imported(module: str, name: str) -> Callable[..., Any]:
    """What calls ``module.name``, importing the module at its first call: a command line can
    name what it would run (a config type, a command) without importing it (torch, say)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return call


def same_named(config_type: type, args: argparse.Namespace) -> dict[str, Any]:
    """{field: value} for the fields of the dataclass ``config_type`` that ``args`` has flags of
    the same names for."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(config_type) if hasattr(args, f.name)}


def count_or_auto(what: str, auto: int) -> Callable[[str], int]:
    """An argparse type: ``auto`` (any case) -> ``auto``, else a number of ``what``."""

    def parse(text: str) -> int:
        if text.strip().lower() == "auto":
            return auto
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {what} or 'auto', got {text!r}") from None

    return parse


def csv(kind: type) -> Callable[[str], tuple]:
    """An argparse type: a comma list of ``kind``, as a tuple."""

    def parse(text: str) -> tuple:
        try:
            return tuple(kind(part) for part in text.split(",") if part)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


class FlagTable(Generic[C]):
    """The flags of one config type ``build`` (a dataclass or a function making one)."""

    def __init__(self, build: Callable[..., C], flags: Iterable[Flag]) -> None:
        self.build = build
        self.flags = list(flags)
        self._by_field = {f.field: f for f in self.flags}

    def select(self, only: Collection[str] | None = None, exclude: Collection[str] = ()) -> list[Flag]:
        if only is not None:
            unknown = set(only) - self._by_field.keys()
            assert not unknown, f"no flag for {sorted(unknown)}"
        return [f for f in self.flags if (only is None or f.field in only) and f.field not in exclude]

    def add(
        self,
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        only: Collection[str] | None = None,
        exclude: Collection[str] = (),
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Adds the flags (``only`` some, or all but ``exclude``), in table order; ``overrides``
        replaces options of some fields where one command words a flag its own way."""
        for flag in self.select(only, exclude):
            options = {**flag.options, **(overrides or {}).get(flag.field, {})}
            parser.add_argument(flag.name, dest=flag.dest, **options)

    def defaults(self) -> dict[str, Any]:
        """{field: the flag's default} for the flags that have one."""
        return {f.field: f.options["default"] for f in self.flags if "default" in f.options}

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """{field: value} for every flag of this table that ``args`` holds."""
        return {f.field: getattr(args, f.dest) for f in self.flags if hasattr(args, f.dest)}

    def default(self, **fields: Any) -> C:
        """The config a command line without these flags gives, with ``fields`` set."""
        return self.build(**{**self.defaults(), **fields})

    def from_args(self, args: argparse.Namespace, **fields: Any) -> C:
        """The config from parsed flags (flags the parser lacks keep their defaults); ``fields``
        set (or replace) fields beside them."""
        return self.build(**{**self.defaults(), **self.values(args), **fields})

    def forward(
        self, args: argparse.Namespace, only: Collection[str] | None = None, exclude: Collection[str] = ()
    ) -> list[str]:
        """The flags in ``args`` again, for a child process, without building the config (so
        without importing what it needs: the child validates them)."""
        return self.to_flags(SimpleNamespace(**{**self.defaults(), **self.values(args)}), only, exclude)

    def to_flags(
        self, config: Any, only: Collection[str] | None = None, exclude: Collection[str] = ()
    ) -> list[str]:
        """Flags that give another process ``config`` (None values and empty lists are left to
        the default)."""
        out: list[str] = []
        for flag in self.select(only, exclude):
            if not flag.forward:
                continue
            value = getattr(config, flag.field)
            if value is None or (isinstance(value, (tuple, list)) and not value):
                continue
            if flag.options.get("action") is argparse.BooleanOptionalAction:
                out.append(flag.name if value else f"--no-{flag.name.removeprefix('--')}")
            elif flag.options.get("action") == "store_true":
                out += [flag.name] if value else []
            elif isinstance(value, (tuple, list)):
                out.append(f"{flag.name}={','.join(map(str, value))}")
            else:
                out.append(f"{flag.name}={value if not isinstance(value, Path) else str(value)}")
        return out
