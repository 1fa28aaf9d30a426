"""A decoder whose layers share weights in a cycle: `cycle` distinct layers repeated `repeats` times.

Layer i computes with the parameters of layer i % cycle (as in Universal-Transformer-style and SPEED's
parameter-shared models). The model is a standard transformers causal LM (Llama here); the sharing is made by
aliasing parameters, not modules: each layer keeps its own module, so its attention keeps its own `layer_idx`
and its own KV-cache layer (aliasing whole layers, `layers[i] = layers[i % cycle]`, would make the repeats
write into one cache layer). The cycle is recorded in the config as `shared_cycle`, so methods can check it.

On disk the folder is an ordinary transformers model with every layer's weights written out (safetensors
refuses tensors that share memory, and transformers ties only the embeddings by itself); `tie` aliases them
again after loading, checking that the copies are equal. `load` does both.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from accelgen.errors import InputError

CONFIG_KEY = "shared_cycle"  # config attribute: the number of distinct layers


def build(vocab_size: int, *, cycle: int, repeats: int, hidden_size: int = 256, intermediate_size: int = 768,
          heads: int = 4, kv_heads: int = 4, max_positions: int = 2048, seed: int = 0, **config_options):
    """A freshly initialised LlamaForCausalLM with cycle × repeats layers sharing weights in a cycle, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if cycle < 1 or repeats < 2:
        raise InputError(f"a shared cycle needs cycle >= 1 and repeats >= 2, got cycle={cycle}, repeats={repeats}")
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=cycle * repeats, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True, **config_options)
    setattr(config, CONFIG_KEY, cycle)
    torch.manual_seed(seed)
    return tie(LlamaForCausalLM(config).float().eval(), check_values=False)


def declared_cycle(model) -> int | None:
    """The cycle the model's config declares (None: not a cycle-shared model)."""
    return getattr(model.config, CONFIG_KEY, None)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder's layer list (the Llama family's model.model.layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise InputError(f"a shared cycle needs a decoder at model.model.layers; {type(model).__name__} has none")
    return layers


def cycle_and_repeats(model, purpose: str) -> tuple[int, int]:
    """(cycle, repeats) of a model whose layers share their parameters in a cycle (the same tensors, not copies);
    a ValueError saying what is wrong otherwise. purpose: who asks, for the messages."""
    cycle = declared_cycle(model)
    name = type(model).__name__
    if cycle is None:
        raise InputError(f"{purpose} needs a model whose decoder layers share weights in a cycle (config.{CONFIG_KEY}; "
                         f"`accelgen train speed-model` builds one); this {name} declares none")
    layers = decoder_layers(model)
    check_shape(len(layers), cycle)
    for index in range(cycle, len(layers)):
        for (key, own), (_, shared) in zip(layers[index].named_parameters(), layers[index % cycle].named_parameters()):
            if own is not shared:
                raise InputError(f"{purpose}: this {name} declares a cycle of {cycle} layers, but layer {index}'s {key} "
                                 f"is not layer {index % cycle}'s (a copy, not the same weights); load it with "
                                 f"accelgen.models.shared_cycle.load, or tie it with shared_cycle.tie")
    return cycle, len(layers) // cycle


def check_shape(layer_count: int, cycle) -> None:
    if not isinstance(cycle, int) or cycle < 1 or layer_count % cycle or layer_count // cycle < 2:
        raise InputError(f"config.{CONFIG_KEY}={cycle!r} does not divide the model's {layer_count} layers into two or "
                         f"more repeats of a cycle")


def tie(model, check_values: bool = True):
    """Make layer i use layer (i % cycle)'s parameters, in place; returns the model. check_values: refuse (a
    ValueError naming the layer) when the weights loaded for a repeat differ from its cycle layer's, so that
    tying never changes what the model computes."""
    cycle = declared_cycle(model)
    if cycle is None:
        raise InputError(f"this {type(model).__name__} declares no shared cycle (config.{CONFIG_KEY}) to tie")
    layers = decoder_layers(model)
    check_shape(len(layers), cycle)
    for index in range(cycle, len(layers)):
        source = dict(layers[index % cycle].named_parameters())
        for key, own in list(layers[index].named_parameters()):
            shared = source[key]
            if own is shared:
                continue
            if check_values and not torch.equal(own.detach().to(shared.device), shared.detach()):
                raise InputError(f"layer {index}'s {key} differs from layer {index % cycle}'s: this is not a model "
                                 f"whose layers share weights in a cycle of {cycle}")
            owner, _, leaf = key.rpartition(".")
            setattr(layers[index].get_submodule(owner) if owner else layers[index], leaf, shared)
    return model


def tie_if_declared(model):
    """tie(model) for a model whose config declares a shared cycle; any other model is returned as it is."""
    return model if declared_cycle(model) is None else tie(model)


def untied_copy(model):
    """A copy of the model with every layer's parameters its own (equal values): what safetensors can save."""
    copied = copy.deepcopy(model)  # keeps the sharing; then each repeat gets tensors of its own
    layers = decoder_layers(copied)
    for index in range(declared_cycle(copied), len(layers)):
        for key, parameter in list(layers[index].named_parameters()):
            owner, _, leaf = key.rpartition(".")
            module = layers[index].get_submodule(owner) if owner else layers[index]
            setattr(module, leaf, torch.nn.Parameter(parameter.detach().clone(), requires_grad=parameter.requires_grad))
    return copied


def save(model, tokenizer, folder) -> None:
    """The model (and tokenizer) as a transformers folder, each file written atomically, config.json last."""
    from accelgen.atomic import save_pretrained_atomically

    cycle_and_repeats(model, "saving a shared-cycle model")
    save_pretrained_atomically(Path(folder), untied_copy(model), tokenizer)


def load(folder, dtype: torch.dtype | str = "auto"):
    """(model, tokenizer) from a folder written by `save`, its layers tied again (checked equal first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    if declared_cycle(model) is None:
        raise InputError(f"{folder} holds a model that declares no shared cycle (config.{CONFIG_KEY})")
    return tie(model), AutoTokenizer.from_pretrained(folder)
