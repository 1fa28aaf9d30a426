"""`accelgen export`: heads trained here, in the checkpoint layouts that vLLM and SGLang load, so that a method
that outgrows one machine serves there (docs/scale-out.md).

Three layouts, each read from the loader's own code (the versions named are those read):

- **EAGLE head → vLLM** (`export_vllm_eagle`; vLLM 0.32 and 0.33, `EagleLlamaForCausalLM` in
  vllm/model_executor/models/llama_eagle.py). The layout of the EAGLE-1 checkpoints vLLM runs
  (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B):
  - `config.json`: a one-layer Llama config. It has architectures ["LlamaForCausalLM"] (vLLM's EAGLEConfig
    prefixes "Eagle"), model_type "llama", and the target's width, MLP size, heads, norm epsilon, rotary
    settings and vocabulary.
  - `model.safetensors`: `fc.weight` (d × 2d, over [token embedding, feature]) and `layers.0.*`, that is the
    attention and MLP projections and `post_attention_layernorm`. The first layer has no input norm there, nor
    here, and vLLM's `fc` has no bias. The embedding and the LM head are the target's: vLLM shares them when the
    checkpoint has none.
  - vLLM drafts an EAGLE-1 head from the whole vocabulary. A head with a draft vocabulary is refused unless
    `whole_vocab` says to drop it.
- **EAGLE-3 head → vLLM** (`export_vllm_eagle3`, chosen by `export_vllm` for a head of the `eagle3` recipe;
  `Eagle3LlamaForCausalLM` in vllm/model_executor/models/llama_eagle3.py, read at vLLM commit
  00bd1493b3e82d6c13c68ee8a0e1c5a96707e190, with the aux-layer choice of vllm/v1/worker/gpu/spec_decode/eagle/
  eagle3_utils.py, get_eagle3_aux_layers_from_config). The layout of the EAGLE-3 checkpoints vLLM runs
  (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B):
  - `model.safetensors`: the head's tensors under their own names, which are the checkpoints': `fc.weight`
    (d × 3d), `midlayer.*` (vLLM renames it `layers.0.`: q/k/v_proj over 2d, o_proj, the MLP, `input_layernorm`,
    `hidden_norm`, `post_attention_layernorm`), `norm.weight`, `lm_head.weight` (draft vocabulary × d), `d2t`
    (draft id → target id offsets, int64) and `t2d` (bool over the target's vocabulary; vLLM skips it). No
    `embed_tokens`: vLLM then shares the target's.
  - `config.json`: the one-layer Llama config with `draft_vocab_size`, `target_hidden_size`,
    `eagle_aux_hidden_state_layer_ids` (the residual-stream indices the head was trained on: vLLM's own default
    is (2, L // 2, L - 3)) and `eagle_config.use_aux_hidden_state`. architectures ["LlamaForCausalLM"]: vLLM's
    EAGLEConfig turns it into Eagle3LlamaForCausalLM for the speculative method "eagle3".
- **EAGLE head → SGLang** (`export_sglang_eagle`; SGLang 0.5.23, `LlamaForCausalLMEagle` in
  python/sglang/srt/models/llama_eagle.py). The same tensors and config, with three differences:
  - architectures is ["LlamaForCausalLMEagle"]: SGLang does not rename a draft's plain LlamaForCausalLM;
  - `fc.bias` is written as zeros: SGLang's `fc` is a torch Linear with its default bias;
  - a draft vocabulary becomes `token_map.pt`, the token ids that `--speculative-token-map` loads
    (`load_token_map` in python/sglang/srt/speculative/spec_utils.py). SGLang then cuts the shared LM head to
    those rows, as accelgen does. SGLang also has a Qwen2ForCausalLMEagle, but it wants q/k/v biases, and the
    head here is a Llama layer that fits any target, so the Llama class serves a Qwen2 target too.
- **Medusa heads → vLLM** (`export_vllm_medusa`; vLLM 0.32, `Medusa` in vllm/model_executor/models/medusa.py
  and `MedusaConfig` in vllm/transformers_utils/configs/medusa.py; vLLM 0.33 removed Medusa).
  - `config.json` has model_type "medusa", architectures ["MedusaModel"], num_heads K, num_hidden_layers 1
    (one residual layer per head) and `medusa_fc_bias`.
  - `model.safetensors` holds `blocks.{k}.layers.0.weight` / `.bias`. vLLM's Medusa does not share the target's
    LM head, so it holds a copy, `lm_head.weight`, with `original_lm_head` saying that one head serves all K.
  - A draft vocabulary maps: `token_map` (the ids) beside `truncated_vocab_size`, and the LM head cut to those
    rows.
  - vLLM drafts the chain of each head's top-1 token, which is accelgen's `blockwise`, not the tree of `medusa`.

Every file is written atomically, and the config goes last (it is removed first on --force). So an interrupted
export is a folder without a config, which no loader takes for a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from accelgen.atomic import save_tensors_atomically, torch_save_atomically, write_json_atomically
from accelgen.errors import InputError
from accelgen.heads import eagle, medusa

CONFIG, WEIGHTS, TOKEN_MAP = "config.json", "model.safetensors", "token_map.pt"
EXPORT_FILES = (CONFIG, WEIGHTS, TOKEN_MAP)  # every file an export may write
DTYPE = torch.bfloat16  # the runtimes cast a draft to the target's dtype; bf16 halves the files
HEADS = {"eagle": "an EAGLE head", "medusa": "Medusa heads"}


# --- the head folder ------------------------------------------------------------------------------------------


def head_kind(head_folder) -> str:
    """"eagle" or "medusa": which trained head head_folder holds, from its metadata file; a clear error if none."""
    folder = Path(head_folder)
    metadata = {"eagle": f"{eagle.NAME}.json", "medusa": f"{medusa.NAME}.json"}
    found = [kind for kind, name in metadata.items() if (folder / name).exists()]
    if not found:
        where = "does not exist" if not folder.exists() else "holds no trained head"
        raise InputError(f"{folder} {where}: no {eagle.NAME}.json (from `accelgen train eagle --out {folder}`) nor "
                         f"{medusa.NAME}.json (from `accelgen train medusa --out {folder}`)")
    if len(found) > 1:
        raise InputError(f"{folder} holds both an EAGLE head and Medusa heads; train them into separate folders")
    return found[0]


def require_kind(head_folder, kind: str, destination: str) -> None:
    """A clear error unless head_folder holds heads of this kind; destination: what loads them, for the message."""
    found = head_kind(head_folder)
    if found != kind:
        elsewhere = {"eagle": "`accelgen export vllm` or `accelgen export sglang`",
                     "medusa": "`accelgen export vllm` (SGLang has no Medusa drafter)"}[found]
        raise InputError(f"{head_folder} holds {HEADS[found]}, and {destination} loads {HEADS[kind]}; "
                         f"export {HEADS[found]} with {elsewhere}")


def load_target(head_folder, name: str | None = None):
    """The target model whose LM head a Medusa export copies: `name`, else the model the heads were trained for."""
    from accelgen.models import load_model
    from accelgen.models.loading import pytorch_weights

    name = name or medusa.MedusaHeads.load(head_folder).base_model
    if not name:
        raise InputError(f"the heads in {head_folder} do not record the model they were trained for; pass --model")
    return load_model(name, weights=pytorch_weights(name, None))[0]


# --- the out folder -------------------------------------------------------------------------------------------


def check_out(out, force: bool) -> Path:
    """out, if an export may go there: a folder that holds anything is refused (FileExistsError) unless force."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a folder")
    held = sorted(path.name for path in out.iterdir()) if out.exists() else []
    if held and not force:
        listed = ", ".join(held[:4]) + (" …" if len(held) > 4 else "")
        raise FileExistsError(f"{out} already holds {listed}; pass --force to overwrite")
    return out


def prepare_out(out, force: bool) -> Path:
    """out, checked (check_out) and ready for an export. The export files already there are removed first, so that
    new weights never pair with an old config and no stale token map stays beside them."""
    out = check_out(out, force)
    for name in EXPORT_FILES:
        (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_export(out: Path, weights: dict, config: dict, token_map: list[int] | None = None) -> list[Path]:
    """model.safetensors, token_map.pt (when given) and config.json in out, each atomically, the config last.
    Returns the files written."""
    written = [save_tensors_atomically(out / WEIGHTS, weights, metadata={"format": "pt"})]
    if token_map is not None:
        written.append(torch_save_atomically(out / TOKEN_MAP, token_map))
    return [*written, write_json_atomically(out / CONFIG, config)]


def in_export_dtype(weights: dict) -> dict:
    return {name: tensor.detach().to(DTYPE) for name, tensor in weights.items()}


# --- EAGLE ----------------------------------------------------------------------------------------------------


def eagle_weights(head: eagle.EagleHead) -> dict:
    """fc.weight (d, 2d) and layers.0.*: the names vLLM and SGLang both read (the layer has no input norm)."""
    layer = {f"layers.0.{name}": tensor for name, tensor in head.layer.state_dict().items()}
    return {"fc.weight": head.fc.weight, **layer}


def eagle_config(head: eagle.EagleHead, architecture: str) -> dict:
    """The head's one-layer Llama config as the runtimes read it."""
    config = json.loads(head.config.to_json_string(use_diff=False))
    config.update(architectures=[architecture], model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
                  dtype="bfloat16", torch_dtype="bfloat16", bias=False)
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)  # where older readers look
    config.pop("_attn_implementation_autoset", None)
    return config


def export_vllm_eagle(head_folder, out, force: bool = False, whole_vocab: bool = False) -> list[Path]:
    """The EAGLE head in head_folder as config.json + model.safetensors in out, for vLLM's speculative config
    {"method": "eagle", "model": out}; returns the files written. A head with a draft vocabulary is refused unless
    whole_vocab: vLLM drafts an EAGLE-1 head from the whole vocabulary."""
    require_kind(head_folder, "eagle", "vLLM's EAGLE export")
    require_recipe(head_folder, "eagle1", "vLLM's EAGLE-1 layout", "export_vllm_eagle3 (`accelgen export vllm`)")
    head = eagle.EagleHead.load(head_folder).float()
    if len(head.vocab) and not whole_vocab:
        raise InputError(
            f"the head in {head_folder} drafts from a vocabulary of {len(head.vocab)} tokens, which vLLM's EAGLE "
            f"cannot load (it drafts from all {head.config.vocab_size}). Pass --whole-vocab to export it drafting from "
            "the whole vocabulary (the output is the same, since verification decides; draft steps cost the whole LM "
            "head), or serve it with SGLang, which loads the draft vocabulary (`accelgen export sglang`)")
    out = prepare_out(out, force)
    return write_export(out, in_export_dtype(eagle_weights(head)), eagle_config(head, "LlamaForCausalLM"))


def export_sglang_eagle(head_folder, out, force: bool = False) -> list[Path]:
    """The EAGLE head in head_folder as config.json + model.safetensors (+ token_map.pt for a draft vocabulary) in
    out, for SGLang's `--speculative-algorithm EAGLE --speculative-draft-model-path out`; returns the files written."""
    require_kind(head_folder, "eagle", "SGLang's EAGLE export")
    require_recipe(head_folder, "eagle1", "SGLang's EAGLE-1 layout", "`accelgen export vllm` (vLLM's eagle3 layout)")
    head = eagle.EagleHead.load(head_folder).float()
    weights = eagle_weights(head)
    weights["fc.bias"] = torch.zeros(head.config.hidden_size)  # SGLang's fc has a bias; the head's fc has none
    token_map = head.vocab.tolist() if len(head.vocab) else None  # a list: what load_token_map turns into ids
    out = prepare_out(out, force)
    return write_export(out, in_export_dtype(weights), eagle_config(head, "LlamaForCausalLMEagle"), token_map)


def require_recipe(head_folder, recipe: str, layout: str, instead: str) -> None:
    """A clear error unless the EAGLE head in head_folder is of this recipe; instead: what exports the other."""
    found = eagle.saved_recipe(head_folder)
    if found != recipe:
        raise InputError(f"the head in {head_folder} is of the {found} recipe, which {layout} does not hold; export it "
                         f"with {instead}")


def eagle3_config(head) -> dict:
    """The EAGLE-3 head's config as vLLM's Eagle3LlamaForCausalLM reads it."""
    config = eagle_config(head, "LlamaForCausalLM")
    layers = list(head.target_layers)
    config.update(draft_vocab_size=len(head.d2t), target_hidden_size=head.config.hidden_size,
                  eagle_aux_hidden_state_layer_ids=layers,
                  eagle_config={"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": layers})
    return config


def export_vllm_eagle3(head_folder, out, force: bool = False) -> list[Path]:
    """The EAGLE-3 head in head_folder as config.json + model.safetensors in out, for vLLM's speculative config
    {"method": "eagle3", "model": out}; returns the files written."""
    require_kind(head_folder, "eagle", "vLLM's EAGLE-3 export")
    require_recipe(head_folder, "eagle3", "vLLM's eagle3 layout", "`accelgen export vllm` (EAGLE-1 layout)")
    head = eagle.EagleHead.load(head_folder).float()
    state = head.state_dict()
    weights = in_export_dtype({name: tensor for name, tensor in state.items() if tensor.is_floating_point()})
    weights.update({name: tensor for name, tensor in state.items() if not tensor.is_floating_point()})  # d2t, t2d
    out = prepare_out(out, force)
    return write_export(out, weights, eagle3_config(head))


# --- Medusa ---------------------------------------------------------------------------------------------------


def export_vllm_medusa(head_folder, out, model, force: bool = False) -> list[Path]:
    """The Medusa heads in head_folder, with a copy of `model`'s LM head (the target they were trained for), as
    config.json + model.safetensors in out, for vLLM's speculative config {"method": "medusa", "model": out};
    returns the files written."""
    require_kind(head_folder, "medusa", "vLLM's Medusa export")
    heads = medusa.MedusaHeads.load(head_folder, model)  # refuses a model of another shape, by name
    lm_head = model.get_output_embeddings()
    if lm_head.bias is not None:
        raise InputError("this model's LM head has a bias, and vLLM's Medusa LM head has none")
    drafted = heads.vocab.cpu() if len(heads.vocab) else None
    weights = {}
    for index, block in enumerate(heads.blocks):
        weights[f"blocks.{index}.layers.0.weight"] = block.weight
        weights[f"blocks.{index}.layers.0.bias"] = block.bias
    weights["lm_head.weight"] = lm_head.weight.cpu() if drafted is None else lm_head.weight.cpu()[drafted]
    weights = in_export_dtype(weights)
    if drafted is not None:
        weights["token_map"] = drafted  # token ids, kept as integers
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": heads.hidden_size,
              "vocab_size": model.config.vocab_size, "num_heads": len(heads), "num_hidden_layers": 1,
              "truncated_vocab_size": model.config.vocab_size if drafted is None else len(drafted),
              "medusa_fc_bias": True, "original_lm_head": True, "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    out = prepare_out(out, force)
    return write_export(out, weights, config)


# --- whichever head -------------------------------------------------------------------------------------------


def export_vllm(head_folder, out, model=None, force: bool = False, whole_vocab: bool = False) -> list[Path]:
    """The head in head_folder for vLLM, EAGLE or Medusa as its metadata says; model: the target, which Medusa
    heads need (vLLM's Medusa keeps its own copy of the LM head)."""
    if head_kind(head_folder) == "eagle":
        if eagle.saved_recipe(head_folder) == "eagle3":  # its own draft vocabulary: vLLM loads it (d2t)
            return export_vllm_eagle3(head_folder, out, force=force)
        return export_vllm_eagle(head_folder, out, force=force, whole_vocab=whole_vocab)
    if model is None:
        raise InputError("Medusa heads export with a copy of the target's LM head: give the target model (--model)")
    return export_vllm_medusa(head_folder, out, model, force=force)


def vllm_speculative_config(out) -> dict:
    """The speculative config that serves the vLLM export in out."""
    config = json.loads((Path(out) / CONFIG).read_text())
    if config["model_type"] == "medusa":  # one drafted token per head
        return {"method": "medusa", "model": str(out), "num_speculative_tokens": config["num_heads"]}
    if "eagle_aux_hidden_state_layer_ids" in config:
        return {"method": "eagle3", "model": str(out), "num_speculative_tokens": 5}
    return {"method": "eagle", "model": str(out), "num_speculative_tokens": 5}


def sglang_arguments(out) -> str:
    """The launch_server arguments that serve the SGLang export in out."""
    arguments = f"--speculative-algorithm EAGLE --speculative-draft-model-path {out}"
    if (Path(out) / TOKEN_MAP).exists():
        arguments += f" --speculative-token-map {Path(out) / TOKEN_MAP}"
    return arguments + " --speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16"
