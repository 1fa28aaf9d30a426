"""`accelgen export vllm HEAD --out DIR`: a trained EAGLE head in the checkpoint layout vLLM's EAGLE proposer
loads, so that heads trained here serve in vLLM:

    LLM(model=TARGET, speculative_config={"method": "eagle", "model": DIR, "num_speculative_tokens": 5})

The layout is that of the EAGLE-1 checkpoints vLLM runs (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B):

- **`config.json`.** A one-layer Llama config: architectures ["LlamaForCausalLM"], model_type "llama",
  num_hidden_layers 1, and the target's hidden size, MLP size, heads, norm epsilon, rotary settings and
  vocabulary.
- **`model.safetensors`.** Holds `fc.weight` (d × 2d, over [token embedding, feature]) and `layers.0.*`: the
  attention and MLP projections and `post_attention_layernorm`. The first layer has no input norm in vLLM's
  EAGLE, nor here. The embedding and the LM head are the target's: vLLM shares them, so they are not
  written.

vLLM drafts from the whole vocabulary; a head's draft vocabulary (train/eagle.py) is not part of the layout.
"""

from __future__ import annotations

import json
from pathlib import Path

from accelgen.atomic import save_tensors_atomically, write_text_atomically
from accelgen.train.eagle import NAME, EagleHead

FILES = ("config.json", "model.safetensors")


def export_vllm_eagle(head_folder, out, force: bool = False) -> list[Path]:
    """Write the head in head_folder as config.json + model.safetensors in out (each atomically); returns the files
    written. Files already in out are refused (FileExistsError) unless force."""
    head_folder, out = Path(head_folder), Path(out)
    if not (head_folder / f"{NAME}.json").exists():
        found = "Medusa heads" if (head_folder / "medusa_heads.json").exists() else "no EAGLE head"
        raise ValueError(f"{head_folder} holds {found}; only EAGLE heads (`accelgen train eagle`) export to vLLM")
    existing = [name for name in FILES if (out / name).exists()]
    if existing and not force:
        raise FileExistsError(f"{out} already holds {' and '.join(existing)}; pass --force to overwrite")
    head = EagleHead.load(head_folder).float()
    weights = {"fc.weight": head.fc.weight}
    weights.update({f"layers.0.{name}": tensor for name, tensor in head.layer.state_dict().items()})
    config = head.config.to_dict()
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, torch_dtype="bfloat16",
                  bias=False, tie_word_embeddings=False)
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)  # where older readers look
    config.pop("_attn_implementation_autoset", None)
    save_tensors_atomically(out / "model.safetensors", {name: tensor.bfloat16() for name, tensor in weights.items()},
                            metadata={"format": "pt"})
    write_text_atomically(out / "config.json", json.dumps(config, indent=1, default=str) + "\n")
    return [out / name for name in FILES]
