"""Command-line flags generated from dataclasses, so that a command's options are written once: a field's name
gives the flag (--batch-size for batch_size), its type and default the flag's, and its metadata the help text,
further names ("-m") and limits ({"min": 1}). A command gets one instance of each dataclass, built from the flags.

    @dataclass
    class Run:
        model: str = flag("smollm2-135m", "Embedded name, HF id or local folder.", "-m")

    train_app.command("layerskip")(command(layerskip, Flags(Run), Flags(LayerSkipConfig, defaults={"rotation": 8})))
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import typer

from accelgen.cli.common import FILE_ERRORS, reported_errors

REQUIRED = ...  # typer's default for an option that must be given
LIMITS = ("min", "max")  # metadata passed on to typer.Option: the range a number must lie in


def flag(default: Any = REQUIRED, help: str | None = None, *names: str, **limits) -> Any:
    """A dataclass field that is a flag: --its-name and `names`, with `help` and `limits` (e.g. min=1)."""
    return field(default=default, metadata={"help": help, "names": names, **limits})


@dataclass(frozen=True)
class Flags:
    """The flags of one dataclass's fields; `defaults` are the command's own where they differ from the fields'."""

    source: type
    defaults: dict = field(default_factory=dict)

    def parameters(self) -> list[inspect.Parameter]:
        types = typing.get_type_hints(self.source)
        return [inspect.Parameter(each.name, inspect.Parameter.KEYWORD_ONLY, annotation=types[each.name],
                                  default=self.option(each))
                for each in dataclasses.fields(self.source)]

    def option(self, each: dataclasses.Field):
        default = self.defaults.get(each.name, each.default)
        names = ("--" + each.name.replace("_", "-"), *each.metadata.get("names", ()))
        limits = {key: value for key, value in each.metadata.items() if key in LIMITS}
        return typer.Option(default, *names, help=each.metadata.get("help"), **limits)

    def build(self, values: dict):
        return self.source(**{each.name: values[each.name] for each in dataclasses.fields(self.source)})


def command(run: Callable[..., None], *sources: Flags) -> Callable[..., None]:
    """A typer command with the flags of `sources` that calls run(*instances), one instance per source (a value a
    dataclass refuses ends the command with its message, exit status 2). Flag names must not repeat."""
    parameters = [parameter for source in sources for parameter in source.parameters()]
    names = [parameter.name for parameter in parameters]
    if len(set(names)) < len(names):
        raise ValueError(f"{run.__name__}: a flag is declared twice among {names}")

    def callback(**values) -> None:
        with reported_errors(FILE_ERRORS):
            instances = [source.build(values) for source in sources]
        run(*instances)

    callback.__signature__ = inspect.Signature(parameters)
    callback.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
    callback.__name__, callback.__doc__ = run.__name__, run.__doc__
    return callback
