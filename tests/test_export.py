"""`accelgen export`: each layout checked against what its loader expects, and run as the runtime runs it.

The expected names, shapes, config keys and loading rules below are data transcribed from the loaders' own code:
vLLM 0.32.0 and 0.33.0 (EAGLE), vLLM 0.32.0 (Medusa, removed in 0.33.0) and SGLang 0.5.23 (EAGLE). Each test loads
the exported files the way that loader does (renames, fused projections, shared embedding and LM head, token
maps), checks that every parameter the runtime's module has is filled with the right shape and that nothing is
left over, then computes the drafts from the loaded tensors as the runtime computes them and compares them with
accelgen's own.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from typer.testing import CliRunner

from accelgen import export
from accelgen.cli import app
from accelgen.heads.eagle import EagleHead, new_head
from accelgen.heads.lm_head import DraftLMHead
from accelgen.heads.medusa import MedusaHeads
from accelgen.train.eagle import whole_windows

# --- what the loaders expect (transcribed) --------------------------------------------------------------------

# vLLM llama_eagle.py, LlamaModel.hf_to_vllm_mapper, and SGLang models/llama.py,
# LlamaForCausalLM._legacy_load_weights's stacked_params_mapping: the checkpoint's separate projections are loaded
# as row blocks of one fused parameter (q, k, v → qkv_proj; gate, up → gate_up_proj).
FUSED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
         ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}


def eagle_parameters(config: dict, fc_bias: bool) -> dict:
    """{parameter: shape} of an EAGLE draft module: vLLM's EagleLlamaForCausalLM / SGLang's LlamaForCausalLMEagle
    (both llama_eagle.py, LlamaModel.__init__): embed_tokens, one decoder layer whose input_layernorm is deleted
    (layer 0), and fc, Linear(2d, d). vLLM's fc is a ReplicatedLinear with bias=False; SGLang's is a torch Linear with
    its default bias. SGLang's LlamaForCausalLMEagle also has an lm_head."""
    d, heads, kv, head_dim, mlp = (config[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                            "head_dim", "intermediate_size"))
    layer = "model.layers.0"
    return {"model.embed_tokens.weight": (config["vocab_size"], d), "model.fc.weight": (d, 2 * d),
            **({"model.fc.bias": (d,)} if fc_bias else {}),
            f"{layer}.self_attn.qkv_proj.weight": ((heads + 2 * kv) * head_dim, d),
            f"{layer}.self_attn.o_proj.weight": (d, heads * head_dim),
            f"{layer}.mlp.gate_up_proj.weight": (2 * mlp, d), f"{layer}.mlp.down_proj.weight": (d, mlp),
            f"{layer}.post_attention_layernorm.weight": (d,)}


# The parameters the runtime fills from the target instead of the checkpoint:
# - vLLM 0.33.0 llm_base_proposer.py: the draft shares the target's embed_tokens and lm_head unless the checkpoint
#   has its own (has_own_embed_tokens / has_own_lm_head, set by utils.process_eagle_weight while loading);
# - SGLang 0.5.23 speculative/eagle_worker_v2.py, init_lm_head: EAGLE (not EAGLE3) drafts get
#   set_embed_and_head(target embed, target head), the head cut to the --speculative-token-map ids.
VLLM_EAGLE_SHARED = {"model.embed_tokens.weight"}
SGLANG_EAGLE_SHARED = {"model.embed_tokens.weight"}  # and lm_head.weight: LlamaForCausalLMEagle.load_weights skips it


def attention_has_bias(config: dict) -> bool:
    """vLLM models/llama.py and SGLang models/llama.py, LlamaDecoderLayer.__init__: the attention projections get a
    bias if config's attention_bias or bias is set (vLLM also reads qkv_bias)."""
    return bool(config.get("attention_bias") or config.get("bias") or config.get("qkv_bias"))


def eagle_loaded(weights: dict) -> dict:
    """{parameter: shape} that vLLM's EagleLlamaForCausalLM.load_weights and SGLang's LlamaForCausalLMEagle.load_weights
    fill from weights: "model." is prefixed to every name without "lm_head" (SGLang drops lm_head names), then
    fused projections are stacked along rows."""
    rows: dict[str, list[tuple]] = {}
    for name, tensor in weights.items():
        if "lm_head" in name:
            continue
        name = "model." + name
        for part, fused in FUSED.items():
            if part in name:
                name = name.replace(part, fused)
                break
        rows.setdefault(name, []).append(tuple(tensor.shape))
    return {name: (sum(shape[0] for shape in shapes), *shapes[0][1:]) for name, shapes in rows.items()}


def sglang_token_map(path) -> torch.Tensor:
    """SGLang 0.5.23 speculative/spec_utils.py, load_token_map, for a local file."""
    return torch.tensor(torch.load(path, weights_only=True), dtype=torch.int64)


def medusa_config(config: dict) -> dict:
    """vLLM 0.32.0 transformers_utils/configs/medusa.py, MedusaConfig.from_pretrained: every key holding "num" and
    "heads" becomes num_heads, "num" and "layers" num_hidden_layers; then __init__'s defaults."""
    parsed = {"num_heads": 5, "num_hidden_layers": 1, "vocab_size": 32001, "truncated_vocab_size": None, **config}
    for key in list(config):
        if "num" in key and "heads" in key:
            parsed["num_heads"] = parsed.pop(key)
        elif "num" in key and "layers" in key:
            parsed["num_hidden_layers"] = parsed.pop(key)
    parsed["truncated_vocab_size"] = parsed["truncated_vocab_size"] or parsed["vocab_size"]
    return parsed


def medusa_parameters(config: dict) -> dict:
    """{parameter: shape} of vLLM 0.32.0's Medusa (models/medusa.py, Medusa.__init__ and ResidualBlock): num_heads
    blocks of num_hidden_layers Linear(d, d) (bias if medusa_fc_bias); with original_lm_head one lm_head of
    truncated_vocab_size rows shared by every head, else lm_heads.{k} of vocab_size rows."""
    d, heads, layers = config["hidden_size"], config["num_heads"], config["num_hidden_layers"]
    parameters = {}
    for k in range(heads):
        for layer in range(layers):
            parameters[f"blocks.{k}.layers.{layer}.weight"] = (d, d)
            if config.get("medusa_fc_bias", False):
                parameters[f"blocks.{k}.layers.{layer}.bias"] = (d,)
    if config.get("original_lm_head", False):
        parameters["lm_head.weight"] = (config["truncated_vocab_size"], d)
    else:
        parameters.update({f"lm_heads.{k}.weight": (config["vocab_size"], d) for k in range(heads)})
    return parameters


def medusa_load(weights: dict, config: dict) -> tuple[dict, torch.Tensor | None]:
    """({parameter: tensor}, token_map) as vLLM 0.32.0's Medusa.load_weights loads them: "medusa_heads." is stripped;
    token_map is kept only if truncated_vocab_size < vocab_size; unknown names are skipped silently, except
    lm_heads.0.weight, which becomes lm_head.weight under original_lm_head; an LM head with more rows than the
    token map is cut to its rows; and it asserts that a truncated vocabulary came with a token map."""
    parameters = medusa_parameters(config)
    token_map, loaded = None, {}
    for name, tensor in weights.items():
        name = name.replace("medusa_heads.", "")
        if name == "token_map":
            if config["truncated_vocab_size"] < config["vocab_size"]:
                token_map = tensor
        elif name in parameters:
            loaded[name] = tensor
        elif config.get("original_lm_head", False) and name == "lm_heads.0.weight":
            loaded["lm_head.weight"] = tensor
    for name, tensor in loaded.items():
        if "lm_head" in name and token_map is not None and tensor.shape[0] > token_map.shape[0]:
            loaded[name] = tensor[token_map]
    assert config["truncated_vocab_size"] == config["vocab_size"] or token_map is not None
    return loaded, token_map


def medusa_drafts(loaded: dict, token_map, config: dict, features: torch.Tensor) -> torch.Tensor:
    """(K, n) the tokens vLLM's Medusa proposes from features (n, d): per head, x + silu(layer(x)) over its layers
    (ResidualBlock.forward), the LM head's logits scattered into the full vocabulary through the token map, -inf
    elsewhere (compute_logits), and their argmax (v1/spec_decode/medusa.py, MedusaProposer.propose)."""
    drafts = []
    for k in range(config["num_heads"]):
        x = features
        for layer in range(config["num_hidden_layers"]):
            x = x + torch.nn.functional.silu(torch.nn.functional.linear(
                x, loaded[f"blocks.{k}.layers.{layer}.weight"], loaded.get(f"blocks.{k}.layers.{layer}.bias")))
        logits = x @ loaded["lm_head.weight"].T
        if token_map is not None:
            full = torch.full((len(x), config["vocab_size"]), float("-inf"))
            full[:, token_map] = logits
            logits = full
        drafts.append(logits.argmax(-1))
    return torch.stack(drafts)


# --- heads built in-test --------------------------------------------------------------------------------------


def exact_in_bf16(module: torch.nn.Module) -> torch.nn.Module:
    """module with its weights rounded to bfloat16 (kept in float32): the export, in bf16, then holds them exactly."""
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(parameter.bfloat16().float())
    return module


@pytest.fixture(scope="module")
def target(make_tiny_model):
    """A tiny Qwen2 target (vocabulary 4096) whose LM head is exact in bf16, as a Medusa export copies it."""
    return exact_in_bf16(make_tiny_model("qwen2", seed=3, vocab_size=4096))


def draft_vocabulary(vocab_size: int, size: int, seed: int) -> torch.Tensor:
    return torch.sort(torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size]).values


def randomized(module, seed: int):
    """module with every parameter drawn from N(0, 0.2²): no part is the identity or zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return module


def eagle_head(target, folder, draft_vocab: int = 0) -> EagleHead:
    """An EAGLE head for target with random weights (no part is the identity or zero), saved in folder."""
    head = randomized(new_head(target), seed=11)
    if draft_vocab:
        head.vocab = draft_vocabulary(target.config.vocab_size, draft_vocab, seed=12)
    exact_in_bf16(head).save(folder)
    return head


def medusa_heads(target, folder, draft_vocab: int = 0, base_model: str = "") -> MedusaHeads:
    """3 Medusa heads for target with random weights, saved in folder."""
    heads = randomized(MedusaHeads(3, target.config.hidden_size, target.config.vocab_size, base_model,
                                   target.config.num_hidden_layers), seed=13)
    if draft_vocab:
        heads.vocab = draft_vocabulary(target.config.vocab_size, draft_vocab, seed=14)
    exact_in_bf16(heads).save(folder)
    return heads


def rebuilt_eagle(config: dict, weights: dict) -> tuple[torch.nn.Module, torch.Tensor | None]:
    """(decoder layer, fc bias) from the exported tensors, computing as the runtimes' EAGLE LlamaModel.forward: fc
    over [embedding, feature], then layer 0 with no input norm, and hidden + residual (a transformers decoder layer
    returns their sum)."""
    layer = LlamaDecoderLayer(LlamaConfig(**{**config, "architectures": None}), layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({name.removeprefix("layers.0."): tensor.float() for name, tensor in weights.items()
                           if name.startswith("layers.0.")})
    return layer.eval(), weights.get("fc.bias")


def run_rebuilt(layer, fc_weight, fc_bias, head: EagleHead, embeds, features) -> torch.Tensor:
    """(1, n, d) the draft feature the runtime's EAGLE module computes from the exported tensors."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    positions, mask = whole_windows(embeds.shape[1])
    hidden = torch.nn.functional.linear(torch.cat([embeds, features], -1), fc_weight.float(),
                                        None if fc_bias is None else fc_bias.float())
    rotary = LlamaRotaryEmbedding(head.config)
    return layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary(hidden, positions))


def random_inputs(target, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """(token embeddings (1, n, d) of random tokens, random features (1, n, d))."""
    generator = torch.Generator().manual_seed(15)
    tokens = torch.randint(0, target.config.vocab_size, (1, length), generator=generator)
    with torch.no_grad():
        embeds = target.get_input_embeddings()(tokens)
    return embeds, torch.randn(1, length, target.config.hidden_size, generator=generator)


# --- vLLM EAGLE -----------------------------------------------------------------------------------------------


def test_vllm_eagle_export_fills_every_parameter_vllm_loads_and_computes_the_head(target, tmp_path):
    head = eagle_head(target, tmp_path / "head")
    written = export.export_vllm_eagle(tmp_path / "head", tmp_path / "vllm")
    assert sorted(path.name for path in written) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    # vLLM transformers_utils/configs/eagle.py, EAGLEConfig: method "eagle" turns each architecture A into EagleA,
    # and EagleLlamaForCausalLM is the registered one; the rest is read as a transformers LlamaConfig
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and not config["tie_word_embeddings"] and not attention_has_bias(config)
    read = LlamaConfig.from_pretrained(tmp_path / "vllm")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "rms_norm_eps", "max_position_embeddings"):
        assert getattr(read, key) == getattr(target.config, key), key
    assert read.rope_parameters["rope_theta"] == target.config.rope_parameters["rope_theta"] == config["rope_theta"]
    weights = load_file(tmp_path / "vllm" / "model.safetensors")
    expected = eagle_parameters(config, fc_bias=False)
    # AutoWeightsLoader raises on a name the module lacks; every other parameter must come from the file
    assert eagle_loaded(weights) == {name: shape for name, shape in expected.items() if name not in VLLM_EAGLE_SHARED}
    layer, fc_bias = rebuilt_eagle(config, weights)
    embeds, features = random_inputs(target)
    with torch.no_grad():
        positions, mask = whole_windows(embeds.shape[1])
        assert torch.allclose(run_rebuilt(layer, weights["fc.weight"], fc_bias, head, embeds, features),
                              head(embeds, features, positions, mask), atol=1e-5)


def test_vllm_eagle_refuses_a_draft_vocabulary_unless_told_to_drop_it(target, tmp_path):
    eagle_head(target, tmp_path / "head", draft_vocab=500)
    with pytest.raises(ValueError, match="vocabulary of 500 tokens, which vLLM's EAGLE cannot load.*--whole-vocab"):
        export.export_vllm_eagle(tmp_path / "head", tmp_path / "vllm")
    assert not (tmp_path / "vllm").exists()
    export.export_vllm_eagle(tmp_path / "head", tmp_path / "vllm", whole_vocab=True)
    assert sorted(path.name for path in (tmp_path / "vllm").iterdir()) == ["config.json", "model.safetensors"]


# --- SGLang EAGLE ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_vocab", [0, 500])
def test_sglang_eagle_export_fills_every_parameter_sglang_loads_and_drafts_the_same_tokens(target, tmp_path,
                                                                                           draft_vocab):
    head = eagle_head(target, tmp_path / "head", draft_vocab)
    written = export.export_sglang_eagle(tmp_path / "head", tmp_path / "sglang")
    token_map_file = tmp_path / "sglang" / "token_map.pt"
    assert sorted(path.name for path in written) == sorted(["config.json", "model.safetensors"]
                                                           + (["token_map.pt"] if draft_vocab else []))
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    # SGLang configs/model_config.py, ModelConfig._config_draft_model renames no LlamaForCausalLM draft: the
    # architecture must name the EAGLE class (models/llama_eagle.py, EntryClass)
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["num_hidden_layers"] == 1
    assert not config["tie_word_embeddings"]  # else LlamaForCausalLMEagle ties lm_head to embed_tokens
    assert not attention_has_bias(config)  # the head's projections have none: SGLang would keep random ones
    weights = load_file(tmp_path / "sglang" / "model.safetensors")
    expected = eagle_parameters(config, fc_bias=True)
    # an unknown name is only logged ("Parameter ... not found"), and a parameter left out keeps its random init
    assert eagle_loaded(weights) == {name: shape for name, shape in expected.items() if name not in SGLANG_EAGLE_SHARED}
    assert torch.equal(weights["fc.bias"], torch.zeros(config["hidden_size"], dtype=torch.bfloat16))
    layer, fc_bias = rebuilt_eagle(config, weights)
    embeds, features = random_inputs(target)
    with torch.no_grad():
        drafted_feature = run_rebuilt(layer, weights["fc.weight"], fc_bias, head, embeds, features)[0]
        positions, mask = whole_windows(embeds.shape[1])
        assert torch.allclose(drafted_feature, head(embeds, features, positions, mask)[0], atol=1e-5)
        # eagle_worker_v2.py: the draft's logits come from the target's LM head cut to the token map's rows, and a
        # drafted index i is the token hot_token_id[i]; accelgen drafts through the same rows (DraftLMHead)
        lm_weight = target.get_output_embeddings().weight
        hot = sglang_token_map(token_map_file) if draft_vocab else torch.arange(target.config.vocab_size)
        assert not draft_vocab or torch.equal(hot, head.vocab)
        sglang_tokens = hot[(drafted_feature @ lm_weight[hot].T).argmax(-1)]
        ours = DraftLMHead(target.get_output_embeddings(), head.vocab)(drafted_feature).argmax(-1)
    assert torch.equal(sglang_tokens, ours)


def test_sglang_refuses_medusa_heads(target, tmp_path):
    medusa_heads(target, tmp_path / "heads")
    with pytest.raises(ValueError, match="holds Medusa heads, and SGLang's EAGLE export loads an EAGLE head.*"
                                         "SGLang has no Medusa drafter"):
        export.export_sglang_eagle(tmp_path / "heads", tmp_path / "out")


# --- vLLM Medusa ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_vocab", [0, 300])
def test_vllm_medusa_export_fills_every_parameter_vllm_loads_and_proposes_the_same_tokens(target, tmp_path,
                                                                                          draft_vocab):
    heads = medusa_heads(target, tmp_path / "heads", draft_vocab)
    export.export_vllm_medusa(tmp_path / "heads", tmp_path / "vllm", target)
    written = json.loads((tmp_path / "vllm" / "config.json").read_text())
    # config/speculative.py, SpeculativeConfig.__post_init__: model_type "medusa" selects method "medusa";
    # models/registry.py maps the architecture MedusaModel to medusa.Medusa
    assert written["model_type"] == "medusa" and written["architectures"] == ["MedusaModel"]
    assert sorted(key for key in written if "num" in key) == ["num_heads", "num_hidden_layers"]  # none renamed astray
    config = medusa_config(written)
    assert (config["num_heads"], config["num_hidden_layers"]) == (3, 1)
    assert (config["hidden_size"], config["vocab_size"]) == (target.config.hidden_size, target.config.vocab_size)
    assert config["truncated_vocab_size"] == (draft_vocab or target.config.vocab_size)
    weights = load_file(tmp_path / "vllm" / "model.safetensors")
    loaded, token_map = medusa_load(weights, config)
    assert {name: tuple(tensor.shape) for name, tensor in loaded.items()} == medusa_parameters(config)
    assert (token_map is not None) == bool(draft_vocab)
    assert not draft_vocab or torch.equal(token_map, heads.vocab)
    features = torch.randn(20, target.config.hidden_size, generator=torch.Generator().manual_seed(16))
    loaded = {name: tensor.float() for name, tensor in loaded.items()}
    with torch.no_grad():
        ours = heads.lm_head(target)(heads(features)).argmax(-1)  # (K, n), as accelgen's MedusaScorer drafts
    assert torch.equal(medusa_drafts(loaded, token_map, config, features), ours)


def test_vllm_medusa_refuses_an_eagle_head_and_a_model_of_another_shape(target, make_tiny_model, tmp_path):
    eagle_head(target, tmp_path / "eagle")
    with pytest.raises(ValueError, match="holds an EAGLE head, and vLLM's Medusa export loads Medusa heads"):
        export.export_vllm_medusa(tmp_path / "eagle", tmp_path / "out", target)
    medusa_heads(target, tmp_path / "heads")
    other = make_tiny_model("qwen2", seed=3, vocab_size=1024)
    with pytest.raises(ValueError, match="vocabulary 4096, the model's is 1024"):
        export.export_vllm_medusa(tmp_path / "heads", tmp_path / "out", other)
    with pytest.raises(ValueError, match="give the target model"):
        export.export_vllm(tmp_path / "heads", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- folders --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exporter", [export.export_vllm_eagle, export.export_sglang_eagle, export.export_vllm])
def test_a_folder_without_a_head_is_refused_by_name(exporter, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty holds no trained head: no eagle_head.json.*nor medusa_heads.json"):
        exporter(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(ValueError, match="missing does not exist"):
        exporter(tmp_path / "missing", tmp_path / "out")


def test_an_eagle_head_refuses_the_vllm_eagle_exporter_for_medusa_heads(target, tmp_path):
    medusa_heads(target, tmp_path / "heads")
    with pytest.raises(ValueError, match="holds Medusa heads, and vLLM's EAGLE export loads an EAGLE head"):
        export.export_vllm_eagle(tmp_path / "heads", tmp_path / "out")


def test_a_non_empty_out_folder_needs_force_which_replaces_an_earlier_export(target, tmp_path):
    eagle_head(target, tmp_path / "head", draft_vocab=200)
    out = tmp_path / "out"
    export.export_sglang_eagle(tmp_path / "head", out)
    assert (out / "token_map.pt").exists()
    with pytest.raises(FileExistsError, match="already holds config.json, model.safetensors, token_map.pt; "
                                              "pass --force"):
        export.export_vllm_eagle(tmp_path / "head", out, whole_vocab=True)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    export.export_vllm_eagle(tmp_path / "head", out, whole_vocab=True, force=True)
    # the earlier export's token map is gone: it would not match this checkpoint
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        export.export_vllm_eagle(tmp_path / "head", tmp_path / "file", whole_vocab=True, force=True)


# --- the command line -----------------------------------------------------------------------------------------


def said(result) -> str:
    """The command's output on one line (the error console wraps long lines)."""
    return " ".join(result.output.split())


def test_export_vllm_tells_medusa_from_eagle_and_loads_the_target_the_heads_name(target, tmp_path):
    target.save_pretrained(tmp_path / "target")
    medusa_heads(target, tmp_path / "heads", base_model=str(tmp_path / "target"))
    result = CliRunner().invoke(app, ["export", "vllm", str(tmp_path / "heads"), "--out", str(tmp_path / "medusa")])
    assert result.exit_code == 0, result.output
    assert '"method": "medusa"' in result.output and '"num_speculative_tokens": 3' in result.output
    assert json.loads((tmp_path / "medusa" / "config.json").read_text())["model_type"] == "medusa"
    eagle_head(target, tmp_path / "head")
    result = CliRunner().invoke(app, ["export", "vllm", str(tmp_path / "head"), "--out", str(tmp_path / "eagle")])
    assert result.exit_code == 0, result.output
    assert '"method": "eagle"' in result.output
    assert json.loads((tmp_path / "eagle" / "config.json").read_text())["model_type"] == "llama"


def test_export_vllm_checks_the_out_folder_before_loading_the_medusa_target(target, tmp_path):
    medusa_heads(target, tmp_path / "heads", base_model=str(tmp_path / "no-such-model"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    full = CliRunner().invoke(app, ["export", "vllm", str(tmp_path / "heads"), "--out", str(tmp_path / "full")])
    assert full.exit_code == 2 and "already holds notes.txt; pass --force" in said(full), full.output
    medusa_heads(target, tmp_path / "unnamed")
    unnamed = CliRunner().invoke(app, ["export", "vllm", str(tmp_path / "unnamed"), "--out", str(tmp_path / "out")])
    assert unnamed.exit_code == 2 and "do not record the model they were trained for" in said(unnamed), said(unnamed)


def test_export_sglang_prints_the_launch_arguments_and_refuses_a_full_folder(target, tmp_path):
    eagle_head(target, tmp_path / "head", draft_vocab=200)
    out = tmp_path / "sglang"
    command = ["export", "sglang", str(tmp_path / "head"), "--out", str(out)]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert f"--speculative-draft-model-path {out} --speculative-token-map {out / 'token_map.pt'}" in result.output
    refused = CliRunner().invoke(app, command)
    assert refused.exit_code == 2 and "--force" in refused.output, refused.output
    assert CliRunner().invoke(app, [*command, "--force"]).exit_code == 0
    missing = CliRunner().invoke(app, ["export", "vllm", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")])
    assert missing.exit_code == 2 and "nothing does not exist" in said(missing), said(missing)


# --- vLLM EAGLE-3 ---------------------------------------------------------------------------------------------
# Transcribed from vLLM's vllm/model_executor/models/llama_eagle3.py at commit
# 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190 (Eagle3LlamaForCausalLM, its LlamaModel and LlamaDecoderLayer).


def eagle3_parameters(config: dict) -> dict:
    """{parameter: shape} of vLLM's Eagle3LlamaForCausalLM: LlamaModel.__init__ has embed_tokens, one
    LlamaDecoderLayer (layer_idx 0: qkv_proj over 2 × hidden_size, input_layernorm, hidden_norm,
    post_attention_layernorm, the MLP), fc = ReplicatedLinear(target_hidden_size × 3, hidden_size, bias=False) (with
    eagle_config.use_aux_hidden_state) and norm; Eagle3LlamaForCausalLM adds lm_head (draft_vocab_size rows) and
    draft_id_to_target_id (draft_vocab_size, long)."""
    d, heads, kv, head_dim, mlp = (config[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                            "head_dim", "intermediate_size"))
    drafted, target_width, layer = config["draft_vocab_size"], config.get("target_hidden_size", d), "model.layers.0"
    return {"model.embed_tokens.weight": (config["vocab_size"], d),
            f"{layer}.self_attn.qkv_proj.weight": ((heads + 2 * kv) * head_dim, 2 * d),
            f"{layer}.self_attn.o_proj.weight": (d, heads * head_dim),
            f"{layer}.mlp.gate_up_proj.weight": (2 * mlp, d), f"{layer}.mlp.down_proj.weight": (d, mlp),
            f"{layer}.input_layernorm.weight": (d,), f"{layer}.hidden_norm.weight": (d,),
            f"{layer}.post_attention_layernorm.weight": (d,),
            "model.fc.weight": (d, 3 * target_width), "model.norm.weight": (d,),
            "lm_head.weight": (drafted, d), "draft_id_to_target_id": (drafted,)}


# Eagle3LlamaForCausalLM.load_weights: without embed_tokens in the checkpoint, "embed_tokens" is a skipped substring
# (the draft shares the target's embedding).
VLLM_EAGLE3_SHARED = {"model.embed_tokens.weight"}


def eagle3_loaded(weights: dict) -> dict:
    """{parameter: shape} that Eagle3LlamaForCausalLM.load_weights fills from weights: names with "t2d" are skipped;
    "d2t" becomes draft_id_to_target_id; "model." is prefixed to names without "lm_head"; then LlamaModel.load_weights
    renames "midlayer." to "layers.0." and stacks the fused projections."""
    rows: dict[str, list[tuple]] = {}
    for name, tensor in weights.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for part, fused in FUSED.items():
            if part in name:
                name = name.replace(part, fused)
                break
        rows.setdefault(name, []).append(tuple(tensor.shape))
    return {name: (sum(shape[0] for shape in shapes), *shapes[0][1:]) for name, shapes in rows.items()}


def vllm_eagle3_logits(weights: dict, config: dict, embeds: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """(n, vocab_size) the draft logits vLLM computes from the exported tensors, for token embeddings (n, d) and the
    target's aux hidden states (n, 3d), causally from position 0: combine_hidden_states (fc); the layer
    (LlamaDecoderLayer.forward, layer_idx 0, norm after residual: residual = hidden, then cat of
    input_layernorm(embeds) and hidden_norm(hidden) into attention; post_attention_layernorm adds the residual; MLP);
    LlamaModel.forward's final norm over hidden + residual; compute_logits: lm_head, scattered to base + d2t, -inf
    elsewhere."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    tensor = {name.replace("midlayer.", "layers.0."): value.float() for name, value in weights.items()}
    eps, layer = config["rms_norm_eps"], "layers.0"

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    heads, kv, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    hidden = aux @ tensor["fc.weight"].T
    residual = hidden
    joined = torch.cat([rms(embeds, tensor[f"{layer}.input_layernorm.weight"]),
                        rms(hidden, tensor[f"{layer}.hidden_norm.weight"])], -1)
    n = len(joined)
    q = (joined @ tensor[f"{layer}.self_attn.q_proj.weight"].T).view(n, heads, head_dim).transpose(0, 1)
    k = (joined @ tensor[f"{layer}.self_attn.k_proj.weight"].T).view(n, kv, head_dim).transpose(0, 1)
    v = (joined @ tensor[f"{layer}.self_attn.v_proj.weight"].T).view(n, kv, head_dim).transpose(0, 1)
    rotary = LlamaRotaryEmbedding(LlamaConfig(**{**config, "architectures": None}))
    cos, sin = rotary(joined[None], torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    k, v = (x.repeat_interleave(heads // kv, dim=1) for x in (k, v[None]))
    attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)[0]
    hidden = attended.transpose(0, 1).reshape(n, -1) @ tensor[f"{layer}.self_attn.o_proj.weight"].T + residual
    residual = hidden
    x = rms(hidden, tensor[f"{layer}.post_attention_layernorm.weight"])
    x = (torch.nn.functional.silu(x @ tensor[f"{layer}.mlp.gate_proj.weight"].T) * (x @ tensor[f"{layer}.mlp.up_proj.weight"].T)
         ) @ tensor[f"{layer}.mlp.down_proj.weight"].T
    logits = rms(x + residual, tensor["norm.weight"]) @ tensor["lm_head.weight"].T
    full = torch.full((n, config["vocab_size"]), float("-inf"))
    full[:, torch.arange(config["draft_vocab_size"]) + weights["d2t"]] = logits
    return full


def eagle3_head(target, folder, draft_vocab: int):
    """An EAGLE-3 head for target with random weights and a random draft vocabulary, saved in folder."""
    from accelgen.heads.eagle3 import new_eagle3_head

    head = new_eagle3_head(target, draft_vocabulary(target.config.vocab_size, draft_vocab, seed=16))
    d2t, t2d = head.d2t.clone(), head.t2d.clone()
    head = exact_in_bf16(randomized(head, seed=17))
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    head.save(folder)
    return head


def test_vllm_eagle3_export_fills_every_parameter_vllm_loads_and_computes_the_head(target, tmp_path):
    head = eagle3_head(target, tmp_path / "head", draft_vocab=700)
    written = export.export_vllm(tmp_path / "head", tmp_path / "vllm")
    assert sorted(path.name for path in written) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    weights = load_file(tmp_path / "vllm" / "model.safetensors")
    # what vLLM reads from the config: the draft vocabulary, the target's width, the aux layers
    # (eagle3_utils.get_eagle3_aux_layers_from_config) and use_aux_hidden_state (LlamaModel.__init__)
    assert config["draft_vocab_size"] == 700 and config["target_hidden_size"] == target.config.hidden_size
    assert config["eagle_aux_hidden_state_layer_ids"] == list(head.target_layers) == [1, 1, 1]
    assert config["eagle_config"]["use_aux_hidden_state"] and config["num_hidden_layers"] == 1
    assert config["architectures"] == ["LlamaForCausalLM"]  # EAGLEConfig makes it Eagle3LlamaForCausalLM
    expected = eagle3_parameters(config)
    assert eagle3_loaded(weights) == {name: shape for name, shape in expected.items() if name not in VLLM_EAGLE3_SHARED}
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert export.vllm_speculative_config(tmp_path / "vllm")["method"] == "eagle3"
    generator = torch.Generator().manual_seed(18)
    tokens = torch.randint(0, target.config.vocab_size, (10,), generator=generator)
    aux = torch.randn(10, 3 * target.config.hidden_size, generator=generator)
    with torch.no_grad():
        embeds = target.get_input_embeddings()(tokens)
        ours = head.vocab_logits(head(embeds[None], head.fuse(aux[None]), *whole_windows(10))[0])
        theirs = vllm_eagle3_logits(weights, config, embeds, aux)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    drafted = ~torch.isinf(ours)
    assert torch.allclose(ours[drafted], theirs[drafted], atol=1e-3) and torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_each_eagle_layout_refuses_the_other_recipe(target, tmp_path):
    eagle3_head(target, tmp_path / "three", draft_vocab=300)
    with pytest.raises(ValueError, match="eagle3 recipe, which vLLM's EAGLE-1 layout does not hold"):
        export.export_vllm_eagle(tmp_path / "three", tmp_path / "a")
    with pytest.raises(ValueError, match="eagle3 recipe, which SGLang's EAGLE-1 layout does not hold"):
        export.export_sglang_eagle(tmp_path / "three", tmp_path / "b")
    eagle_head(target, tmp_path / "one")
    with pytest.raises(ValueError, match="eagle1 recipe, which vLLM's eagle3 layout does not hold"):
        export.export_vllm_eagle3(tmp_path / "one", tmp_path / "c")
