"""Every file accelgen writes is written whole or not at all, and every file it reads back is checked.

Writing: the content goes to a hidden temporary file beside the target (`.NAME.<random>.partial`), is flushed to
the disk (fsync), then renamed over the target (`os.replace`, atomic on POSIX and Windows). A crash or a kill at
any moment leaves the old file or the new one, never a truncated or half-written one; at worst a stray
`.partial` file, which nothing reads.

Reading: `read_checked` turns whatever a loader raises on an empty, truncated or foreign file into a
CorruptFileError (a ValueError) naming the file and the command that fixes it.

See docs/atomic-files.md for the files written this way and what a load does with a damaged one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable, TypeVar

from accelgen.errors import InputError

T = TypeVar("T")


class CorruptFileError(InputError):
    """A file that cannot be what it should be (empty, truncated, or not matching the files beside it)."""


# --- writing -----------------------------------------------------------------------------------------------


def partial_path(path: Path) -> Path:
    """A fresh hidden name beside path for its content in progress (random: concurrent writers never share one)."""
    return path.parent / f".{path.name}.{secrets.token_hex(4)}.partial"


def write_atomically(path, write: Callable[[Path], None]) -> Path:
    """Call write(temporary path) beside `path`, flush it to the disk, then rename it to `path`: a reader never sees
    a partial file, and a failed write leaves none behind (a killed one leaves only a hidden .partial file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    try:
        write(partial)
        _fsync(partial)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return path


def write_text_atomically(path, text: str) -> Path:
    return write_atomically(path, lambda partial: partial.write_text(text, encoding="utf-8"))


def write_json_atomically(path, content) -> Path:
    """content as indented JSON, ending with a newline."""
    return write_text_atomically(path, json.dumps(content, indent=1) + "\n")


def torch_save_atomically(path, content) -> Path:
    import torch

    return write_atomically(path, lambda partial: torch.save(content, partial))


def save_tensors_atomically(path, tensors: dict, metadata: dict | None = None) -> Path:
    """A safetensors file of tensors (made contiguous)."""
    from safetensors.torch import save_file

    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    return write_atomically(path, lambda partial: save_file(contiguous, str(partial), metadata=metadata))


def save_npy_atomically(path, array) -> Path:
    import numpy as np

    def write(partial: Path) -> None:
        with open(partial, "wb") as file:  # a file object: np.save would add ".npy" to a path's name
            np.save(file, array)

    return write_atomically(path, write)


def save_figure_atomically(figure, path, dpi: int = 120) -> Path:
    """A matplotlib figure, in the format its name ends with (the temporary name has no such ending)."""
    path = Path(path)
    return write_atomically(path, lambda partial: figure.savefig(partial, dpi=dpi, format=path.suffix.lstrip(".")))


def save_pretrained_atomically(folder, *parts) -> None:
    """Save parts (a model, a tokenizer: anything with save_pretrained) into folder, each file atomically.
    config.json, which makes a folder a model, is removed first and moved in last: an interrupted save leaves a
    folder that does not load, never one that loads a mix of old and new weights."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").unlink(missing_ok=True)
    partial = partial_path(folder / "save")
    try:
        for part in parts:
            part.save_pretrained(partial)
        for file in sorted(partial.iterdir(), key=lambda file: file.name == "config.json"):
            _fsync(file)
            os.replace(file, folder / file.name)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    _fsync_folder(folder)


def _fsync(path: Path) -> None:
    with open(path, "rb+") as file:
        os.fsync(file.fileno())


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable (POSIX; Windows cannot open a folder)."""
    if hasattr(os, "O_DIRECTORY"):
        handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


# --- reading -----------------------------------------------------------------------------------------------


def read_checked(path, read: Callable[[Path], T], fix: str) -> T:
    """read(path), with any error but a missing file raised as a CorruptFileError naming the file; fix: what the
    user should do about it ("delete it and rerun ...")."""
    path = Path(path)
    try:
        return read(path)
    except FileNotFoundError:
        raise
    except Exception as error:
        reason = (str(error).strip().splitlines() or [""])[0].split(". ")[0][:160]  # its first sentence
        raise CorruptFileError(f"{path} is unreadable ({type(error).__name__}: {reason}): it is empty, truncated or "
                               f"not the file it should be; {fix}") from error


def load_torch(path, fix: str):
    """torch.load of tensors and plain types only (weights_only: a crafted file cannot run code), onto the CPU."""
    import torch

    return read_checked(path, lambda file: torch.load(file, weights_only=True, map_location="cpu"), fix)


def load_tensors(path, fix: str) -> dict:
    """A safetensors file's tensors."""
    from safetensors.torch import load_file

    return read_checked(path, load_file, fix)
