"""Command-line options derived from a config dataclass, so a setting is written once.

A field made with ``setting(default, "--flag", "help", type=..., ...)`` carries its flag,
its help and click's keywords in its metadata. ``@options(Config)`` adds one click option
per such field, in field order, whose value reaches the command under the field's name,
so the command builds ``Config(**values)`` without naming a field; ``flag_of(Config,
name)`` gives a field's flag for messages. A field without a flag is a setting of the
library alone.

    @dataclass(frozen=True)
    class Config:
        seed: int = setting(0, "--seed", "Seeds the encoding.", show_default=True)
        limit: int = 8  # no flag

    @click.command()
    @options(Config)
    def run(**settings):
        go(Config(**settings))
"""

from __future__ import annotations

import dataclasses
import math

import click

from prep.base.storage import local_only

_KEY = "option"  # the metadata key of a field's option
_SAME = object()  # the option's default: the field's


def setting(default, flag: str | None = None, help=None, *, cli_default=_SAME,  # noqa: A002
            meta: dict | None = None, **click_kw) -> dataclasses.Field:
    """A dataclass field with ``default`` whose option is ``flag``; ``help`` is a string or
    a function that returns one (called when the options are built, so it may name other
    fields' flags); ``cli_default`` where the option's default is not the field's (None:
    a flag not given can be told apart); ``meta``: more metadata of the caller's own."""
    option = None if flag is None else dict(flag=flag, help=help, default=cli_default,
                                            click=click_kw)
    return dataclasses.field(default=default, metadata={**(meta or {}), _KEY: option})


def _option_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get(_KEY)]


def options(cls):
    """A decorator adding the click options of ``cls``'s fields, in field order."""

    def decorate(fn):
        for f in reversed(_option_fields(cls)):  # click lists the last one applied first
            o = f.metadata[_KEY]
            default = f.default if o["default"] is _SAME else o["default"]
            text = o["help"]() if callable(o["help"]) else o["help"]
            kw = dict(o["click"], help=text)
            if not (kw.get("is_flag") and default is False):  # a flag is off unless given
                kw["default"] = default
            fn = click.option(o["flag"], f.name, **kw)(fn)
        return fn

    return decorate


def flag_of(cls, name: str) -> str | None:
    """The flag of field ``name`` of ``cls``, or None where it has none."""
    option = next((f.metadata.get(_KEY) for f in dataclasses.fields(cls) if f.name == name),
                  None)
    return option["flag"] if option else None


class Parsed(click.ParamType):
    """A click type from ``parse(text)`` (ValueError: the message of a bad value); values
    that are not text (a default) pass as they are."""

    def __init__(self, name: str, parse):
        self.name, self.parse = name, parse

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return self.parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class Finite(click.FloatRange):
    """A FloatRange that refuses nan and inf too (nan passes its comparisons): every float
    option of `prep` and `train`. TrainConfig holds each field of this type to it, flag or
    not (a run's config.json, the library)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{rv} is not a finite number.", param, ctx)
        return rv


class LocalPath(click.Path):
    """A click.Path of a command that reads (or, ``output``, writes) local paths only: a
    bucket path is refused in one line saying what to do (prep.base.storage.local_only)."""

    def __init__(self, *, output: bool = False, **kw):
        super().__init__(**kw)
        self.output = output

    def convert(self, value, param, ctx):
        why = local_only(value, output=self.output) if isinstance(value, str) else None
        if why:
            self.fail(why, param, ctx)
        return super().convert(value, param, ctx)
