"""`accelgen export vllm|sglang`: heads trained here, in the checkpoint layouts other runtimes load."""

from __future__ import annotations

import json
from typing import Optional

import typer

from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import App

export_app = App(no_args_is_help=True, help="Export trained drafters for other runtimes.")

EXPORT_OUT_HELP = "Folder for the checkpoint; one that holds anything is refused without --force."
EXPORT_FORCE_HELP = "Write into a non-empty --out, replacing an earlier export there."


@export_app.command("vllm")
def export_vllm(
    head: str = typer.Argument(..., help="A head folder: `accelgen train eagle` or `accelgen train medusa --out ...`."),
    out: str = typer.Option(..., "--out", help=EXPORT_OUT_HELP),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Medusa heads: the target whose LM head vLLM "
                                        "needs a copy of (default: the model the heads were trained for)."),
    whole_vocab: bool = typer.Option(False, "--whole-vocab", help="EAGLE: export a head trained with a draft "
                                     "vocabulary, drafting from the whole vocabulary (vLLM's EAGLE loads no other)."),
    force: bool = typer.Option(False, "--force", help=EXPORT_FORCE_HELP),
):
    """An EAGLE head or Medusa heads (told apart by the folder's files) in the checkpoint layout vLLM loads."""
    from accelgen import export

    with reported_errors(FILE_ERRORS):
        target = None
        if export.head_kind(head) == "medusa":
            export.check_out(out, force)  # before loading the target, which may take a while
            target = export.load_target(head, model)
        written = export.export_vllm(head, out, target, force=force, whole_vocab=whole_vocab)
    speculative_config = export.vllm_speculative_config(out)
    medusa_note = " (Medusa: vLLM 0.32 or older)" if speculative_config["method"] == "medusa" else ""
    console.print(f"wrote {', '.join(path.name for path in written)} to {out}; serve with{medusa_note}:\n"
                  f"vllm serve TARGET --speculative-config '{json.dumps(speculative_config)}'", soft_wrap=True)


@export_app.command("sglang")
def export_sglang(
    head: str = typer.Argument(..., help="An EAGLE head folder (`accelgen train eagle --out ...`)."),
    out: str = typer.Option(..., "--out", help=EXPORT_OUT_HELP),
    force: bool = typer.Option(False, "--force", help=EXPORT_FORCE_HELP),
):
    """An EAGLE head in the checkpoint layout SGLang's EAGLE loads, its draft vocabulary as a token map."""
    from accelgen import export

    with reported_errors(FILE_ERRORS):
        written = export.export_sglang_eagle(head, out, force=force)
    console.print(f"wrote {', '.join(path.name for path in written)} to {out}; serve with:\n"
                  f"python -m sglang.launch_server --model-path TARGET {export.sglang_arguments(out)}", soft_wrap=True)
