"""A model's checkpoint read in one given weight format: where its weights come from (an embedded default, a HF
model id, a local folder or a .gguf file), the device and dtype they go to, and the converted and quantized copies
kept in the cache folder.

GGUF files are dequantized by transformers once and cached as bf16 safetensors, so later loads take seconds; with
weights="gguf" the file itself is run by llama.cpp (models/llamacpp.py). This is the loading side of models/: it
imports the engines it loads into, never the other way round. `load_model` (models/loading.py) is the entry point:
it chooses the format for weights="auto" by the probe (models/probe.py), which loads each candidate from here.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from accelgen.atomic import write_atomically
from accelgen.errors import InputError
from accelgen.models.embedded import EMBEDDED_MODELS, remove_assembled
from accelgen.models.llamacpp import LlamaCppModel
from accelgen.models.shared_cycle import tie_if_declared

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
CACHE_DTYPE = torch.bfloat16


def stderr_progress(verb: str, unit: str):
    """A progress(done, total, name) callback for a long conversion: "<verb> done/total <unit> (name) in Ns" on
    stderr at most every 5 seconds, and at the end; its clock starts now."""
    started, shown = time.perf_counter(), [0.0]

    def progress(done: int, total: int, name: str) -> None:
        elapsed = time.perf_counter() - started
        if done == total or elapsed - shown[0] >= 5:
            shown[0] = elapsed
            print(f"accelgen: {verb} {done}/{total} {unit} ({name}) in {elapsed:.0f}s", file=sys.stderr)

    return progress


def cache_dir() -> Path:
    """Where converted models live: $ACCELGEN_CACHE, else the user's cache folder."""
    if env := os.environ.get("ACCELGEN_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "accelgen"


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}") from None


DEVICE_HELP = "cpu, cuda, cuda:N or auto (default: cpu)"
DEVICE_CHOICES = "cpu, cuda, cuda:N or auto"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """Where a model runs: None and "cpu" the CPU; "cuda" the current CUDA device, "cuda:N" that one; "auto" CUDA
    when torch sees a device, else the CPU. A device that is not there is a ValueError that says so."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, torch.device):
        resolved = device
    else:
        text = str(device).strip().lower()
        if text == "auto":
            return resolve_device("cuda" if torch.cuda.is_available() else "cpu")
        if not re.fullmatch(r"(cpu|cuda)(:\d+)?", text):  # "cpu:0" too, as torch and accelerate write it
            raise InputError(f"unknown device {device!r}: choose {DEVICE_CHOICES}")
        resolved = torch.device(text)
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise InputError(f"device {str(resolved)!r} is not supported: choose {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built for CPU"
        raise InputError(f"device {str(device)!r} asked for, but torch sees no CUDA device (torch {torch.__version__}, "
                         f"{built})")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise InputError(f"device {str(device)!r} asked for, but torch sees {count} CUDA device{'s' * (count != 1)} "
                         f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
    return torch.device("cuda", index)


def beside_weights(model, filename: str, saving: str | None = None) -> Path | None:
    """A file in the folder the model was loaded from (where tuning results are kept). For a model not
    loaded from a folder: None, or, when `saving` names what is to be saved there, a ValueError."""
    folder = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    if folder and Path(folder).is_dir():
        return Path(folder) / filename
    if saving is not None:
        raise InputError(f"this model was not loaded from a folder, so there is nowhere beside it to save {saving}")
    return None


def cached_model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def is_cached(name: str) -> bool:
    return (cached_model_dir(name) / "config.json").is_file()


def prepare_embedded(name: str) -> Path:
    """Folder of the embedded model `name` as safetensors, assembling and converting it on first use."""
    model = EMBEDDED_MODELS[name]
    folder = cached_model_dir(name)
    if not is_cached(name):
        work_dir = cache_dir() / "gguf"
        gguf_path = model.gguf_path(work_dir)
        _convert_gguf(gguf_path, folder)
        remove_assembled(work_dir, model)
    return folder


def gguf_file(name_or_path: str) -> Path:
    """The GGUF file of an embedded model (assembled from its packages into the cache if split) or a user's
    .gguf path: what llama.cpp runs."""
    if name_or_path in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[name_or_path].gguf_path(cache_dir() / "gguf")
    path = Path(name_or_path).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise InputError(f"{name_or_path!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}) nor a .gguf file; "
                         "llama.cpp runs GGUF files only")
    return path


def prepare_gguf(path: Path) -> Path:
    """Folder of a user's .gguf file as safetensors, keyed by path, size and modification time."""
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cached_model_dir(f"gguf-{path.stem}-{key}")
    if not (folder / "config.json").is_file():
        _convert_gguf(path, folder)
    return folder


def require_gguf_extra() -> None:
    """transformers reads GGUF files with `gguf` and `accelerate`, which only the gguf extra installs."""
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"reading GGUF files needs {module}: pip install 'accelgen[gguf]'", name=module)


def _convert_gguf(gguf_path: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    require_gguf_extra()

    print(f"accelgen: dequantizing {gguf_path.name} once (this takes a minute); caching in {folder}", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=CACHE_DTYPE,
        quantization_config=GgufConfig(dequantize=True),  # plain dense weights, whatever kernels are installed
    )
    # The weights are plain tensors now; a saved quantization_config would ask for GGUF again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".partial"))
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        if (folder / "config.json").is_file():  # another process finished the same conversion first
            shutil.rmtree(partial)
        else:
            shutil.rmtree(folder, ignore_errors=True)  # an incomplete leftover
            partial.replace(folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    print(f"accelgen: cached {folder.name}", file=sys.stderr)


WEIGHTS = ("auto", "gguf", "fp32", "bf16", "int8", "int4")
QUANTIZED = ("int8", "int4")
WEIGHTS_HELP = ("Weight format: fp32, bf16, int8, int4 (weight-only quantized), gguf (the GGUF file run by llama.cpp) "
                "or auto (the fastest on this machine, measured once and cached).")
DRAFT_WEIGHTS_HELP = "Weight format of the draft model (as --weights); the output never depends on it."


def check_weights(weights: str | None) -> None:
    if weights is not None and weights not in WEIGHTS:
        raise InputError(f"unknown weights format {weights!r}; choose one of {', '.join(WEIGHTS)}")


def load_format(
    name_or_path: str,
    weights: str | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    threads: int | None = None,
):
    """(model, tokenizer) in one given weight format (load_model's, except "auto", which load_model resolves by
    the probe: models/loading.py, models/probe.py). The arguments are load_model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_weights(weights)
    if weights == "auto":
        raise InputError("weights='auto' is chosen by a probe: load the model with accelgen.models.loading.load_model")
    check_source(name_or_path)
    target = resolve_device(device)
    on_gpu = target.type != "cpu"
    if weights == "gguf":
        if on_gpu:
            raise InputError(f"weights=gguf runs on llama.cpp's CPU engine only, not on {target}: choose bf16, fp32, "
                             "int8 or int4 there (or leave out the device)")
        return load_llamacpp(name_or_path, threads)
    if weights in ("fp32", "bf16"):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[weights]
    torch_dtype = resolve_dtype(dtype)
    if torch_dtype is None and on_gpu:
        torch_dtype = torch.bfloat16  # a GPU's matrix units are fastest in bf16 (checkpoints are often fp32)
    quantized = weights in QUANTIZED
    compute_dtype = torch_dtype or torch.bfloat16  # of the quantized formats
    if quantized:
        from accelgen.models.formats import kernel_error

        if (error := kernel_error(weights, compute_dtype, str(target))) is not None:  # said before anything loads
            raise InputError(f"weights={weights} cannot run on {target} in this PyTorch build ({torch.__version__}): "
                             f"{error}")
    if name_or_path in EMBEDDED_MODELS:
        folder = prepare_embedded(name_or_path)
        torch_dtype = torch_dtype or torch.bfloat16
    elif name_or_path.endswith(".gguf"):
        folder = prepare_gguf(Path(name_or_path).expanduser())
        torch_dtype = torch_dtype or torch.bfloat16
    else:
        folder = name_or_path
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(
        # quantized formats quantize the checkpoint's own values; the dtype is then the compute dtype
        folder, dtype="auto" if quantized else torch_dtype or "auto", attn_implementation=attn_implementation
    )
    model = tie_if_declared(model)  # a shared-cycle model (SPEED): its repeated layers share weights again
    if quantized:
        from accelgen.models.formats import move_to

        quantize_cached(model, weights, local_folder(str(folder)), compute_dtype)  # on the CPU, as cached
        move_to(model, target)  # int4 is packed anew for a GPU's kernel
    else:
        model.to(target)
    model.eval()
    return model, tokenizer


def check_source(name_or_path: str) -> None:
    """Refuse early, by name, a model that is none of an embedded name, a .gguf file, a folder or a hub id."""
    path = Path(str(name_or_path)).expanduser()
    if name_or_path in EMBEDDED_MODELS or path.is_dir():
        return
    if str(name_or_path).endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return
    looks_like_path = path.is_absolute() or str(name_or_path).startswith((".", "~")) or path.exists()
    if looks_like_path or str(name_or_path).count("/") > 1:
        raise InputError(f"no model at {name_or_path!r}: give an embedded name ({', '.join(EMBEDDED_MODELS)}), "
                         "a model folder, a .gguf file or a hub id")
    # a hub id without an owner (gpt2) is possible, but one this close to an embedded name is a misspelling
    close = difflib.get_close_matches(str(name_or_path).lower(), EMBEDDED_MODELS, n=1)
    if close and "/" not in str(name_or_path):
        raise InputError(f"unknown model {name_or_path!r}: did you mean {close[0]}? Embedded models: "
                         f"{', '.join(EMBEDDED_MODELS)}; or give a model folder, a .gguf file or a hub id")
    check_hub_reachable(str(name_or_path))


def check_hub_reachable(model_id: str) -> None:
    """Refuse in seconds a hub id that is not in the HF cache when the hub cannot be reached: offline by
    HF_HUB_OFFLINE=1, or with no network, where downloading it would spend about a minute on retries first."""
    if local_folder(model_id) is not None:
        return  # cached: transformers loads it from there
    from huggingface_hub import constants

    alternatives = f"give an embedded model ({', '.join(EMBEDDED_MODELS)}), a model folder or a .gguf file"
    if constants.HF_HUB_OFFLINE:
        raise InputError(f"model {model_id!r} is not in the Hugging Face cache, and HF_HUB_OFFLINE=1 allows no "
                         f"download: {alternatives}, or unset HF_HUB_OFFLINE to download it")
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # the hub may be reachable through the proxy only: let the download try
    import socket
    from urllib.parse import urlsplit

    endpoint = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=3).close()
    except OSError as error:
        raise InputError(f"cannot reach {constants.ENDPOINT} to download {model_id!r} ({error}): with no network, "
                         f"{alternatives}; HF_HUB_OFFLINE=1 loads models from the Hugging Face cache only") from None


def local_folder(name_or_path: str) -> Path | None:
    """The folder a model's weights were read from: the path itself, or a hub id's snapshot in the HF cache."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(name_or_path, "config.json")
    except Exception:  # noqa: BLE001 - not a hub id: nothing to key a cache by
        return None
    return Path(config).parent if isinstance(config, str) else None


def quantize_cached(model, fmt: str, folder: Path | None, compute_dtype: torch.dtype) -> None:
    """Quantize the model's linear layers to fmt in place, reading the quantized tensors from the cache when a
    previous load saved them, else quantizing them (with progress on stderr) and saving them atomically."""
    from safetensors.torch import load_file

    from accelgen.models.formats import quantize

    path = quantized_cache_path(folder, fmt) if folder is not None else None
    if path is not None and path.is_file():
        # copied out of the file's memory map: the packed kernels read their weights with aligned vector loads,
        # which a tensor at an arbitrary offset of the file fails (a segmentation fault, not an error)
        quantize(model, fmt, {key: value.clone() for key, value in load_file(path).items()}, compute_dtype)
        return
    name = folder.name if folder is not None else model.config.name_or_path
    print(f"accelgen: quantizing {name} to {fmt} once; later loads read it from the cache", file=sys.stderr)
    started, progress = time.perf_counter(), stderr_progress("quantized", "layers")
    saved = quantize(model, fmt, None, compute_dtype, progress)
    if path is not None:
        write_atomically(path, lambda partial: save_quantized(saved, partial))
        print(f"accelgen: {fmt} tensors cached as {path.name} in {time.perf_counter() - started:.0f}s", file=sys.stderr)


def save_quantized(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({key: value.contiguous() for key, value in tensors.items()}, str(path),
              metadata={"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()})


def quantized_cache_path(folder: Path, fmt: str) -> Path | None:
    """Where the quantized tensors of the weights in `folder` are cached (None: no weight files there), keyed by
    the weight files' paths, sizes and times, the format, the torch version and the CPU capability it packs for
    (the int4 layout follows the vector width)."""
    files = sorted([*folder.glob("*.safetensors"), *folder.glob("*.bin")]) if folder.is_dir() else []
    if not files:
        return None
    stamp = ";".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    text = f"{stamp}|{fmt}|{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}"
    key = hashlib.sha1(text.encode()).hexdigest()[:16]
    return cache_dir() / "quantized" / f"{folder.name}-{fmt}-{key}.safetensors"


def load_llamacpp(name_or_path: str, threads: int | None = None) -> tuple[LlamaCppModel, object]:
    """(model, tokenizer) for an embedded model's or a user's GGUF file, run by llama.cpp on its own weights.

    The tokenizer is transformers' reading of the same file, saved in the cache after the first load."""
    from transformers import AutoTokenizer

    path = gguf_file(name_or_path)
    model = LlamaCppModel(path, threads=threads or torch.get_num_threads())
    saved = cache_dir() / "tokenizers" / f"{path.stem}-{path.stat().st_size}"
    if (saved / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(saved)
    else:
        require_gguf_extra()
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        partial = saved.with_name(saved.name + ".partial")
        tokenizer.save_pretrained(partial)
        partial.replace(saved)  # written whole, then renamed
    model.generation_config = _generation_config(tokenizer)
    return model, tokenizer


def _generation_config(tokenizer):
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
