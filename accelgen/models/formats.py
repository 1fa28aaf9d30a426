"""Weight formats: how a model's linear layers are stored and multiplied.

    fp32, bf16   dense weights in that dtype
    int8         weight-only int8, one scale per output channel (torch._weight_int8pack_mm)
    int4         weight-only int4, asymmetric, one scale and zero point per group of 64 inputs
                 (torch._weight_int4pack_mm_for_cpu)

The quantized formats keep activations, norms, attention and the embedding lookup in the compute dtype
(bf16: PyTorch's packed CPU kernels are fast only with bf16 activations) and quantize every nn.Linear of
the decoder and the LM head. Lossless claims hold relative to the target *as loaded*: a method is exact
against `autoregressive` with the same weights, not against the bf16 model.
"""

from __future__ import annotations

import torch

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
INT4_GROUP_SIZE = 64


class QuantizedLinear(torch.nn.Module):
    """A weight-only quantized nn.Linear over PyTorch's own packed CPU kernels.

    int8: weight (out, in) int8, scales (out,); int4: packed (out, in // 2) uint8 in the CPU kernel's layout,
    scales_and_zeros (in // group, out, 2). Activations are cast to `compute_dtype` for the kernel and the
    output cast back, so the layer fits a model whose other parts run in any dtype.
    """

    def __init__(self, bits: int, in_features: int, out_features: int, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype, group_size: int = INT4_GROUP_SIZE):
        super().__init__()
        self.bits, self.in_features, self.out_features = bits, in_features, out_features
        self.group_size, self.compute_dtype = group_size, compute_dtype
        if bits == 8:
            self.register_buffer("weight_int8", torch.empty(out_features, in_features, dtype=torch.int8))
            self.register_buffer("scales", torch.empty(out_features, dtype=compute_dtype))
        else:
            self.register_buffer("weight_int4", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
            self.register_buffer("scales_and_zeros",
                                 torch.empty(in_features // group_size, out_features, 2, dtype=compute_dtype))
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def weight_format(self) -> str:
        return f"int{self.bits}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in_features)
        shape, dtype = x.shape, x.dtype
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype)
        if self.bits == 8:
            out = torch._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        else:
            out = torch._weight_int4pack_mm_for_cpu(flat, self.weight_int4, self.group_size, self.scales_and_zeros)
        out = out.reshape(*shape[:-1], self.out_features).to(dtype)
        return out if self.bias is None else out + self.bias.to(dtype)

    def extra_repr(self) -> str:
        return f"int{self.bits}, in_features={self.in_features}, out_features={self.out_features}"


def weight_format(model: torch.nn.Module) -> str:
    """The format a model's linear layers are in: int8/int4 if any is quantized, else its parameters' dtype."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            return module.weight_format
    dtype = next(model.parameters()).dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> (int8 (out, in), scales (out,)): symmetric, one scale per output channel."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127
    return (weight / scales[:, None]).round().clamp(-128, 127).to(torch.int8), scales


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> (packed (out, in // 2) uint8, scales_and_zeros (in // group, out, 2)): asymmetric
    4-bit, one scale and zero point per group of inputs, in the layout torch._weight_int4pack_mm_for_cpu reads
    (w ≈ (q − 8) · scale + zero, q in 0..15)."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (out, in // group)
    scales = (high - low).clamp(min=1e-8) / 15
    zeros = low + 8 * scales
    quantized = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(quantized.reshape(out_features, in_features), 1)
    return packed, torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()


def quantizable_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """(name, layer) of every nn.Linear of the decoder and the LM head."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def check_quantizable(model: torch.nn.Module, fmt: str) -> None:
    """Raise a ValueError naming the first layer that `fmt` cannot hold, or the kernel this torch build lacks."""
    if fmt not in ("int8", "int4"):
        raise ValueError(f"unknown quantized format {fmt!r}; choose int8 or int4")
    kernel = "_weight_int8pack_mm" if fmt == "int8" else "_weight_int4pack_mm_for_cpu"
    if not hasattr(torch, kernel):
        raise ValueError(f"weights={fmt} needs torch.{kernel}, which this PyTorch build ({torch.__version__}) lacks")
    for name, layer in quantizable_linears(model):
        if fmt == "int4" and layer.in_features % INT4_GROUP_SIZE:
            raise ValueError(f"weights=int4 quantizes inputs in groups of {INT4_GROUP_SIZE}, but layer {name!r} has "
                             f"{layer.in_features} inputs; use weights=int8")


def quantized_layer(layer: torch.nn.Linear, fmt: str, compute_dtype: torch.dtype,
                    tensors: dict[str, torch.Tensor] | None = None) -> QuantizedLinear:
    """A QuantizedLinear for `layer`, from its weight or from already quantized `tensors` (a cache)."""
    bits = 8 if fmt == "int8" else 4
    quantized = QuantizedLinear(bits, layer.in_features, layer.out_features, layer.bias, compute_dtype)
    if tensors is None:
        with torch.no_grad():
            if bits == 8:
                weight, scales = quantize_int8(layer.weight)
                tensors = {"weight_int8": weight, "scales": scales}
            else:
                packed, scales_and_zeros = quantize_int4(layer.weight)
                tensors = {"weight_int4": packed, "scales_and_zeros": scales_and_zeros}
    for key, value in tensors.items():
        getattr(quantized, key).copy_(value)
    return quantized


def quantize(model: torch.nn.Module, fmt: str, cached: dict[str, torch.Tensor] | None = None,
             compute_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Replace the model's linear layers by `fmt` (int8/int4) QuantizedLinears, in place; returns their
    quantized tensors by `layer.buffer` name (what a cache saves), reading them from `cached` when given.
    The rest of the model (embeddings, norms, attention) moves to compute_dtype."""
    check_quantizable(model, fmt)
    model.to(compute_dtype)
    saved: dict[str, torch.Tensor] = {}
    for name, layer in quantizable_linears(model):
        tensors = None
        if cached is not None:
            tensors = {key.rpartition(".")[2]: value for key, value in cached.items() if key.rpartition(".")[0] == name}
        quantized = quantized_layer(layer, fmt, compute_dtype, tensors or None)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, quantized)
        saved.update({f"{name}.{key}": buffer for key, buffer in quantized.named_buffers()})
    return saved
