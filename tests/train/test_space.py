"""SPACE's training (train/space.py over train/mask_tokens.py): its mask-position LoRA trains (the base model does
not), and the command line trains tokens that `generate --method space` uses (the layout with the LoRA on:
test_mask_tokens.py)."""

import json

import torch
from transformers import AutoModelForCausalLM

from accelgen.heads.mask_tokens import MaskTokens
from accelgen.train.mask_tokens import train_mask_tokens
from accelgen.train.space import SpaceConfig, new_space_tokens


def test_the_lora_and_masks_train_and_the_model_does_not(tiny_target, tiny_target_windows):
    rows = []
    before = [parameter.clone() for parameter in tiny_target.parameters()]
    config = SpaceConfig(count=2, rank=4, steps=30, cuts=6, learning_rate=0.1, lora_learning_rate=0.01)
    tokens = new_space_tokens(tiny_target, config)
    assert [name for name in tokens.lora_modules][:2] == ["model.layers.0.self_attn.q_proj",
                                                          "model.layers.0.self_attn.k_proj"]
    train_mask_tokens(tiny_target, tokens, tiny_target_windows[:2], config, progress=rows.append)
    first, last = (sum(row["loss"] for row in part) / len(part) for part in (rows[:5], rows[-5:]))
    assert last < first - 1.0, (first, last)
    assert all(float(p.detach().abs().max()) > 0 for p in tokens.lora.parameters())  # B started at zero
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_target.parameters()))


def test_the_command_trains_tokens_that_generate_uses(command_inputs, tmp_path):
    from typer.testing import CliRunner

    from accelgen.cli import app

    model, dataset = command_inputs(seed=0)
    out = tmp_path / "space"
    trained = CliRunner().invoke(app, ["train", "space", "--model", str(model), "--dataset", dataset, "--out", str(out),
                                       "--count", "2", "--rank", "2", "--lora-modules", "q_proj,v_proj",
                                       "--windows", "12", "--held-out", "2", "--seq-len", "24", "--steps", "3",
                                       "--cuts", "4"])
    assert trained.exit_code == 0, trained.output
    assert json.loads((out / "evaluation.json").read_text())["method"] == "space"
    tokens = MaskTokens.load(out, AutoModelForCausalLM.from_pretrained(model), "space")
    assert tokens.rank == 2 and len(tokens.lora) == 4  # q and v of both layers
    runs = [CliRunner().invoke(app, ["generate", "def add(a, b):", "--model", str(model), "-n", "12", "--json",
                                     *extra]) for extra in ([], ["--method", "space", "--head", str(out)])]
    assert all(run.exit_code == 0 for run in runs), runs[1].output
    plain, drafted = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    assert drafted["token_ids"] == plain["token_ids"]
