"""Command-line flags generated from dataclasses, so that a command's options are written once: a field's name
gives the flag (--batch-size for batch_size), its type and default the flag's, and its metadata the help text,
further names ("-m") and limits ({"min": 1}). A command gets one instance of each dataclass, built from the flags.

    @dataclass
    class Run:
        model: str = flag("smollm2-135m", "Embedded name, HF id or local folder.", "-m")

    train_app.command("layerskip")(command(layerskip, Flags(Run), Flags(LayerSkipConfig, defaults={"rotation": 8})))

It also holds what makes every command read and show its flags alike (App): -h is help, a flag shows as typed
(`--chat`, not `--chat <bool>`), arguments in the usage line as PROMPT and [MODEL], and a flag given a value
(`--chat true`) is told it takes none.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import typer
from typer.core import TyperCommand, TyperGroup

from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.errors import InputError

REQUIRED = ...  # typer's default for an option that must be given
LIMITS = ("min", "max")  # metadata passed on to typer.Option: the range a number must lie in
# The help of fields many trainers' configs share, where a field has none of its own
COMMON_HELP = {
    "steps": "Training steps.",
    "learning_rate": "Learning rate.",
    "batch_size": "Examples per step.",
    "seq_len": "Tokens per training window.",
    "checkpoint_every": "Steps between checkpoints in --out (a rerun resumes from the last).",
    "seed": "Random seed (same seed, same run).",
    "eval_every": "Steps between held-out evaluations (0: only at the end).",
    "max_grad_norm": "Gradients are clipped to this norm.",
    "max_new_tokens": "Most tokens generated per prompt.",
}


def flag(default: Any = REQUIRED, help: str | None = None, *names: str, **limits) -> Any:
    """A dataclass field that is a flag: --its-name and `names`, with `help` and `limits` (e.g. min=1)."""
    return field(default=default, metadata={"help": help, "names": names, **limits})


@dataclass(frozen=True)
class Flags:
    """The flags of one dataclass's fields; `defaults` are the command's own where they differ from the fields'."""

    source: type
    defaults: dict = field(default_factory=dict)
    # field -> its flag, where the field's own name would mean another thing on the command line (MedusaConfig's
    # heads, a count, is --num-heads: --heads is a heads folder); the old flag still works, hidden, with a note
    renamed: dict = field(default_factory=dict)

    def parameters(self) -> list[inspect.Parameter]:
        types = typing.get_type_hints(self.source)
        parameters = []
        for each in dataclasses.fields(self.source):
            parameters.append(inspect.Parameter(each.name, inspect.Parameter.KEYWORD_ONLY,
                                                annotation=types[each.name], default=self.option(each)))
            if each.name in self.renamed:
                old = typer.Option(None, own_flag(each.name), hidden=True, help=f"Now {self.renamed[each.name]}.")
                parameters.append(inspect.Parameter(DEPRECATED + each.name, inspect.Parameter.KEYWORD_ONLY,
                                                    annotation=Optional[types[each.name]], default=old))
        return parameters

    def option(self, each: dataclasses.Field):
        default = self.defaults.get(each.name, each.default)
        names = (self.renamed.get(each.name, own_flag(each.name)), *each.metadata.get("names", ()))
        limits = {key: value for key, value in each.metadata.items() if key in LIMITS}
        return typer.Option(default, *names, help=each.metadata.get("help") or COMMON_HELP.get(each.name), **limits)

    def build(self, values: dict):
        for name, new in self.renamed.items():
            if values.get(DEPRECATED + name) is not None:
                console.print(f"note: {own_flag(name)} is now {new}")
                values = {**values, name: values[DEPRECATED + name]}
        return self.source(**{each.name: values[each.name] for each in dataclasses.fields(self.source)})


DEPRECATED = "deprecated_"  # the parameter of a renamed field's old flag


def own_flag(name: str) -> str:
    """The flag a field's name gives: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")


def command(run: Callable[..., None], *sources: Flags) -> Callable[..., None]:
    """A typer command with the flags of `sources` that calls run(*instances), one instance per source (a value a
    dataclass refuses ends the command with its message, exit status 2). Flag names must not repeat."""
    parameters = [parameter for source in sources for parameter in source.parameters()]
    names = [parameter.name for parameter in parameters]
    if len(set(names)) < len(names):
        raise InputError(f"{run.__name__}: a flag is declared twice among {names}")

    def callback(**values) -> None:
        with reported_errors(FILE_ERRORS):
            instances = [source.build(values) for source in sources]
        run(*instances)

    callback.__signature__ = inspect.Signature(parameters)
    callback.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
    callback.__name__, callback.__doc__ = run.__name__, run.__doc__
    return callback


HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
BOOLEAN_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0"}


class Typed:
    """What a command and a group share: help showing a flag as it is typed (`--chat`, not typer's `--chat <bool>`),
    and a flag given a value (`--chat true "x"`) told it takes none, not that "x" is an unexpected extra argument."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""  # the type column stays empty: a flag takes no value
        return params

    def parse_args(self, ctx, args):
        given = list(args)
        try:
            return super().parse_args(ctx, args)
        except Exception as error:  # a usage error (exit 2) of whichever click typer runs on (it may vendor one)
            misread = getattr(error, "exit_code", None) == 2 and flag_given_a_value(self.get_params(ctx), given)
            if not misread:
                raise
            ctx.fail(misread)


def flag_given_a_value(params, args: list[str]) -> str | None:
    """What to say where a flag is followed by a word such as true or false, taken for its value; else None."""
    flags = {name: param for param in params if getattr(param, "is_flag", False) and not getattr(param, "count", False)
             for name in param.opts + param.secondary_opts}
    for name, following in zip(args, args[1:]):
        if name == "--":
            break
        if name in flags and following.lower() in BOOLEAN_WORDS:
            other = [each for each in flags[name].opts + flags[name].secondary_opts if each != name]
            return (f"{name} is a flag and takes no value: write {name} alone, not {name} {following}"
                    + (f" (or {' / '.join(other)})" if other else ""))
    return None


class PlainCommand(Typed, TyperCommand):
    """A command whose usage line names its arguments as they are written: PROMPT, [MODEL], not {prompt}."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = (param.metavar or param.name).upper() + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
        return pieces


class PlainGroup(Typed, TyperGroup):
    """A command group (its commands are PlainCommands where its Typer is an App)."""


class App(typer.Typer):
    """A typer.Typer whose commands and groups read and show their flags alike: -h is help, see Typed."""

    def __init__(self, *, cls=PlainGroup, context_settings: dict | None = None, **settings):
        super().__init__(cls=cls, context_settings={**HELP_OPTIONS, **(context_settings or {})}, **settings)

    def command(self, name: str | None = None, *, cls=PlainCommand, **settings):
        return super().command(name, cls=cls, **settings)
