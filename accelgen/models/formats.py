"""Weight formats: how a model's linear layers are stored and multiplied.

    fp32, bf16   dense weights in that dtype
    int8         weight-only int8, symmetric, one scale per output channel (torch._weight_int8pack_mm)
    int4         weight-only int4, asymmetric, one scale and zero point per group of 64 inputs
                 (torch._weight_int4pack_mm_for_cpu; on CUDA torch._weight_int4pack_mm)

The quantized formats quantize every nn.Linear of the decoder and the LM head, and keep the input embedding,
norms and attention in the compute dtype: bf16 by default, as PyTorch's packed CPU kernels are fast only with
bf16 activations (with fp32 ones they were 5-25x slower on an AVX2 CPU). With tied embeddings the lookup table
stays dense and the LM head gets its own quantized copy. Lossless claims hold relative to the target *as
loaded*: a method is exact against `autoregressive` with the same weights, not against the bf16 model.

Shape rules of the kernels (checked before quantizing, as a wrong shape gives wrong numbers or a crash
rather than an error): int8 needs in_features % 8 == 0; int4 needs in_features % 64 == 0 (the groups) and
out_features % 16 == 0 (the packing).

On a GPU: int8's kernel takes the same tensors on CUDA, so `.to(device)` moves them. int4's CUDA kernel reads
another packing (and bf16 activations only), so a model is quantized on the CPU (and cached in the CPU packing),
then `move_to` unpacks each int4 layer's levels and packs them anew for CUDA. A layer knows its packing by its
shape: (out, in // 2) uint8 for the CPU, a 4-d int32 tensor for CUDA.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch

from accelgen.errors import InputError

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
QUANTIZED_FORMATS = ("int8", "int4")
INT4_GROUP_SIZE = 64
KERNELS = {"int8": ("_weight_int8pack_mm",),
           "int4": ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")}
CUDA_KERNELS = {"int8": ("_weight_int8pack_mm",), "int4": ("_convert_weight_to_int4pack", "_weight_int4pack_mm")}
TENSORS = {"int8": ("weight_int8", "scales"), "int4": ("weight_int4", "scales_and_zeros")}  # per layer, as cached
INT4_INNER_K_TILES = 2  # CUDA's int4 packing: in_features must be a multiple of 16 * this (int4's groups of 64 are)


class QuantizedLinear(torch.nn.Module):
    """A weight-only quantized nn.Linear over PyTorch's own packed kernels (the CPU's, and CUDA's).

    int8: weight_int8 (out, in) int8 and scales (out,); int4: weight_int4 (out, in // 2) uint8 in the CPU kernel's
    packed layout (or, after `move_to` a CUDA device, the CUDA kernel's) and scales_and_zeros (in // group, out, 2).
    The scales' dtype is the compute dtype (`.to(dtype)` moves it with the rest of the model): activations are cast
    to it for the kernel and the output cast back.
    """

    def __init__(self, fmt: str, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16, group_size: int = INT4_GROUP_SIZE):
        super().__init__()
        if fmt not in QUANTIZED_FORMATS:
            raise InputError(f"unknown quantized format {fmt!r}; choose {' or '.join(QUANTIZED_FORMATS)}")
        self.fmt, self.group_size = fmt, group_size
        self._dense: torch.Tensor | None = None  # the dequantized weight, once something reads .weight
        self.out_features = packed.shape[0]
        self.in_features = packed.shape[1] * (1 if fmt == "int8" else 2)
        if fmt == "int8":
            self.register_buffer("weight_int8", packed)  # (out, in) int8
            self.register_buffer("scales", scales.to(compute_dtype))  # (out,)
        else:
            self.register_buffer("weight_int4", packed)  # (out, in // 2) uint8, packed
            self.register_buffer("scales_and_zeros", scales.to(compute_dtype))  # (in // group, out, 2)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(compute_dtype), requires_grad=False)

    @property
    def weight_format(self) -> str:
        return self.fmt

    @property
    def compute_dtype(self) -> torch.dtype:
        return (self.scales if self.fmt == "int8" else self.scales_and_zeros).dtype

    @property
    def weight(self) -> torch.Tensor:
        """The dense (out, in) weight this layer stands for, in the compute dtype: for code that reads an LM head's
        rows, as draft heads do. Computed on first access and kept (that layer then also costs its dense size)."""
        if self._dense is None or self._dense.dtype != self.compute_dtype:
            self._dense = dequantize(self).to(self.compute_dtype)
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in_features)
        shape, dtype = x.shape, x.dtype
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype)  # (tokens, in)
        if flat.requires_grad and torch.is_grad_enabled():  # training through a frozen quantized model
            out = _KernelWithInputGrad.apply(flat, self)
        else:
            out = self.kernel(flat)
        out = out.reshape(*shape[:-1], self.out_features).to(dtype)  # (..., out)
        return out if self.bias is None else out + self.bias.to(dtype)

    @property
    def packing(self) -> str:
        """The device type whose kernel the weights are packed for: "cuda" or "cpu" (int8: "any", one layout)."""
        if self.fmt == "int8":
            return "any"
        return "cuda" if self.weight_int4.dim() == 4 else "cpu"

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        """(tokens, in) in the compute dtype -> (tokens, out), by PyTorch's packed kernel."""
        if self.fmt == "int8":
            return torch._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        if self.packing != flat.device.type:  # moved by .to(device), which cannot repack
            raise InputError(f"this int4 layer is packed for the {self.packing}'s kernel but runs on {flat.device}: "
                             "load the model there (load_model(..., device=...)) or move it with "
                             "accelgen.models.formats.move_to")
        if self.packing == "cuda":
            return torch._weight_int4pack_mm(flat, self.weight_int4, self.group_size, self.scales_and_zeros)
        return torch._weight_int4pack_mm_for_cpu(flat, self.weight_int4, self.group_size, self.scales_and_zeros)

    def pack_for(self, device: torch.device) -> None:
        """Pack an int4 layer's weights for the kernel of `device` (moving them there); int8 needs no packing."""
        if self.fmt != "int4" or self.packing == device.type:
            return
        if self.packing == "cuda" or device.type != "cuda":
            raise InputError(f"int4 weights packed for the {self.packing} cannot be packed for {device}: load the "
                             "model there instead (load_model(..., device=...)); int4 runs on the CPU and on CUDA")
        levels = unpack_int4(self.weight_int4)  # (out, in) int32 in 0..15
        self.weight_int4 = pack_int4_for_cuda(levels.to(device))
        self._dense = None

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"


class _KernelWithInputGrad(torch.autograd.Function):
    """The packed kernels have no derivative; the gradient with respect to the input is grad · W, with W the
    dequantized weight (the weights themselves stay frozen). Lets heads train on a quantized target's outputs."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer
        return layer.kernel(flat)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # grad: (tokens, out)
        return grad @ ctx.layer.weight.to(grad.dtype), None  # (tokens, in)


def weight_format(model: torch.nn.Module) -> str:
    """The format a model's linear layers are in: int8/int4 if any is quantized, else its parameters' dtype."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            return module.weight_format
    dtype = next(model.parameters()).dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> (int8 (out, in), fp32 scales (out,)): symmetric, one scale per output channel,
    w ≈ q · scale."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127  # (out,)
    return (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def int4_levels(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight (out, in) -> (levels (out, in) int32 in 0..15, scales (out, in // group), lows (out, in // group)):
    w ≈ level · scale + low within each group of `group_size` inputs."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (out, groups)
    scales = (high - low).clamp(min=1e-8) / 15
    levels = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32)
    return levels.reshape(out_features, in_features), scales, low


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> (packed (out, in // 2) uint8, fp32 scales_and_zeros (in // group, out, 2)): asymmetric
    4-bit in the layout torch._weight_int4pack_mm_for_cpu reads, which computes w = (q − 8) · scale + zero for
    q in 0..15; so zero = low + 8 · scale."""
    levels, scales, low = int4_levels(weight, group_size)
    packed = torch._convert_weight_to_int4pack_for_cpu(levels, 1)  # (out, in // 2) uint8
    zeros = low + 8 * scales  # (out, groups)
    return packed, torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(out, in // 2) uint8 packed by torch._convert_weight_to_int4pack_for_cpu -> levels (out, in) int32.

    The CPU packing works in blocks of `block` output rows (the vector width: 32 rows with AVX2, 64 with AVX-512)
    and puts rows d and d + block/2 of a block into one byte per input; a shorter last block pairs neighbouring
    rows. The block is found once by packing a probe and checked exactly, so a PyTorch build with another layout
    gets a clear error rather than wrong weights."""
    return _unpack_int4(packed, _int4_block())


def pack_int4_for_cuda(levels: torch.Tensor) -> torch.Tensor:
    """levels (out, in) int32 in 0..15, on a CUDA device -> the layout torch._weight_int4pack_mm reads: two inputs
    per byte (the even one in the high half), packed by torch._convert_weight_to_int4pack. Its w = (q − 8) · scale +
    zero is the CPU kernel's, so scales_and_zeros stay as they are."""
    pairs = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)  # (out, in // 2)
    return torch._convert_weight_to_int4pack(pairs, INT4_INNER_K_TILES)


def _unpack_int4(packed: torch.Tensor, block: int) -> torch.Tensor:
    out_features, half = packed.shape
    flat = packed.reshape(-1)
    levels = torch.empty(out_features, 2 * half, dtype=torch.uint8)
    full = out_features // block * block  # rows in whole blocks
    if full:
        pairs = flat[:full * half].reshape(full // block, 2 * half, block // 2)  # (blocks, in, block / 2)
        rows = levels[:full].reshape(full // block, 2, block // 2, 2 * half)  # (blocks, halves, block / 2, in)
        rows[:, 0], rows[:, 1] = (pairs & 15).transpose(1, 2), (pairs >> 4).transpose(1, 2)
    if full < out_features:
        pairs = flat[full * half:].reshape(2 * half, (out_features - full) // 2)  # (in, rows / 2)
        levels[full::2], levels[full + 1::2] = (pairs & 15).T, (pairs >> 4).T
    return levels.to(torch.int32)


@lru_cache(maxsize=1)
def _int4_block() -> int:
    generator = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 16, (3 * 64 + 16, 128), dtype=torch.int32, generator=generator)
    packed = torch._convert_weight_to_int4pack_for_cpu(probe, 1)
    for block in (32, 64, 16, 128):
        if torch.equal(_unpack_int4(packed, block), probe):
            return block
    raise InputError(f"this PyTorch build ({torch.__version__}, {torch.backends.cpu.get_cpu_capability()}) packs int4 "
                     "weights in a layout accelgen cannot read back; int4 layers run, but their dense weight is "
                     "not available")


def dequantize(layer: QuantizedLinear) -> torch.Tensor:
    """The fp32 (out, in) weight a QuantizedLinear multiplies by."""
    if layer.fmt == "int4" and layer.packing == "cuda":  # a packing accelgen does not unpack: read it by the kernel
        identity = torch.eye(layer.in_features, dtype=layer.compute_dtype, device=layer.weight_int4.device)
        return layer.kernel(identity).T.float()  # row i of the product is row i of the transposed weight
    if layer.fmt == "int8":
        return layer.weight_int8.float() * layer.scales.float()[:, None]
    scales, zeros = layer.scales_and_zeros.float().transpose(0, 1).unbind(-1)  # (out, groups) each
    levels = unpack_int4(layer.weight_int4).float().reshape(layer.out_features, -1, layer.group_size)
    return ((levels - 8) * scales[..., None] + zeros[..., None]).reshape(layer.out_features, layer.in_features)


def quantizable_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """(name, layer) of every nn.Linear of the model: a causal LM's decoder layers and its LM head."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def shape_error(fmt: str, in_features: int, out_features: int) -> str | None:
    """Why `fmt` cannot hold a linear layer of this shape (None: it can)."""
    if fmt == "int8" and in_features % 8:
        return "int8's kernel reads inputs in blocks of 8"
    if fmt == "int4" and in_features % INT4_GROUP_SIZE:
        return f"int4 quantizes inputs in groups of {INT4_GROUP_SIZE}"
    if fmt == "int4" and out_features % 16:
        return "int4's packing needs a multiple of 16 outputs"
    return None


@lru_cache(maxsize=None)
def kernel_error(fmt: str, compute_dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> str | None:
    """None if this PyTorch build runs `fmt`'s kernels on `device` (probed once with a tiny layer quantized on the
    CPU, then moved there), else which kernel failed."""
    on = torch.device(device)
    names = KERNELS[fmt] + (CUDA_KERNELS[fmt] if on.type == "cuda" else ())
    missing = [name for name in dict.fromkeys(names) if not hasattr(torch, name)]
    if missing:
        return f"torch.{missing[0]} is missing"
    layer = torch.nn.Linear(64, 16)  # the smallest shape both kernels take
    try:
        probe = move_to(quantized_layer(layer, fmt, compute_dtype), on)
        probe(torch.ones(2, 64, dtype=compute_dtype, device=on))
    except Exception as error:  # noqa: BLE001 - any failure of the kernel means the format cannot run here
        kernels = " / ".join(f"torch.{name}" for name in dict.fromkeys(names))
        return f"{kernels} failed on a {compute_dtype} probe: {type(error).__name__}: {error}"
    return None


def move_to(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """model.to(device), with every int4 layer first packed for the device's kernel (CPU and CUDA pack differently)."""
    device = torch.device(device)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.pack_for(device)
    return model.to(device)


def check_quantizable(model: torch.nn.Module, fmt: str, compute_dtype: torch.dtype = torch.bfloat16) -> None:
    """Raise a ValueError naming the kernel this torch build lacks or the first layer `fmt` cannot hold."""
    if fmt not in QUANTIZED_FORMATS:
        raise InputError(f"unknown quantized format {fmt!r}; choose {' or '.join(QUANTIZED_FORMATS)}")
    if (error := kernel_error(fmt, compute_dtype)) is not None:
        raise InputError(f"weights={fmt} cannot run in this PyTorch build ({torch.__version__}): {error}")
    for name, layer in quantizable_linears(model):
        if (reason := shape_error(fmt, layer.in_features, layer.out_features)) is not None:
            raise InputError(f"weights={fmt} cannot hold layer {name!r} of shape (out {layer.out_features}, "
                             f"in {layer.in_features}): {reason}"
                             + ("; use weights=int8" if shape_error("int8", layer.in_features, 0) is None else ""))


def quantized_tensors(layer: torch.nn.Linear, fmt: str) -> dict[str, torch.Tensor]:
    """The quantized tensors of one layer, as the cache saves them (scales in fp32, whatever the compute dtype)."""
    with torch.no_grad():
        if fmt == "int8":
            weight, scales = quantize_int8(layer.weight)
            return {"weight_int8": weight, "scales": scales}
        packed, scales_and_zeros = quantize_int4(layer.weight)
        return {"weight_int4": packed, "scales_and_zeros": scales_and_zeros}


def quantized_layer(layer: torch.nn.Linear, fmt: str, compute_dtype: torch.dtype = torch.bfloat16,
                    tensors: dict[str, torch.Tensor] | None = None) -> QuantizedLinear:
    """A QuantizedLinear for `layer`, from its weight or from its already quantized `tensors` (a cache)."""
    tensors = tensors or quantized_tensors(layer, fmt)
    packed, scales = (tensors[key] for key in TENSORS[fmt])
    return QuantizedLinear(fmt, packed, scales, layer.bias, compute_dtype)


def quantize(model: torch.nn.Module, fmt: str, cached: dict[str, torch.Tensor] | None = None,
             compute_dtype: torch.dtype = torch.bfloat16,
             progress: Callable[[int, int, str], None] | None = None) -> dict[str, torch.Tensor]:
    """Replace the model's linear layers by `fmt` (int8/int4) QuantizedLinears, in place, quantizing each from its
    own weight (or reading its tensors from `cached`, keyed `layer.tensor`), then move the rest of the model
    (embeddings, norms, attention) to compute_dtype. Returns the quantized tensors by `layer.tensor` name: what
    a cache saves. progress(done, total, layer name) is called after each layer."""
    check_quantizable(model, fmt, compute_dtype)
    layers = quantizable_linears(model)
    saved: dict[str, torch.Tensor] = {}
    for done, (name, layer) in enumerate(layers, 1):
        tensors = None
        if cached is not None:
            tensors = {key: cached[f"{name}.{key}"] for key in TENSORS[fmt] if f"{name}.{key}" in cached}
            if len(tensors) != len(TENSORS[fmt]):
                raise InputError(f"the cached {fmt} tensors lack layer {name!r}")
        tensors = tensors or quantized_tensors(layer, fmt)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child,
                quantized_layer(layer, fmt, compute_dtype, tensors))
        saved.update({f"{name}.{key}": value for key, value in tensors.items()})
        if progress is not None:
            progress(done, len(layers), name)
    model.to(compute_dtype)
    return saved
