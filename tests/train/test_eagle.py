"""EAGLE head training: an untrained head passes the feature through, training beats it on held-out windows,
checkpoints resume, the target's features are cached once, the draft vocabulary and the command line (the
exports to vLLM and SGLang: tests/test_export.py)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from accelgen.cli import app
from accelgen.heads.eagle import new_head
from accelgen.train import eagle
from accelgen.train.eagle import EagleConfig, collect_features, evaluate_eagle, train_eagle
from accelgen.train.layerskip import packed_windows


SMALL = dict(batch_size=4, learning_rate=1e-2, ce_weight=1.0, noise=0.0, draft_vocab=0)


@pytest.fixture(scope="module")
def data(tiny_target, tokenizer, own_continuations):
    """(windows, features, choices) of the tiny target's own greedy text: 12 windows of 32 tokens."""
    texts = [tokenizer.decode(tokens) for tokens in
             own_continuations(tiny_target, tokenizer, [[start, 17, 923] for start in range(5, 17)], 40)]
    windows = packed_windows(tokenizer, texts, seq_len=32, count=12)
    return (windows, *collect_features(tiny_target, windows))


@pytest.mark.slow  # SmolLM2 features and 25 steps; the tiny-model tests here train EAGLE heads by default
def test_training_beats_the_untrained_head_on_held_out_windows(smollm):
    """SmolLM2 on ShareGPT text: a few seconds of training make the head's guesses of the model's next choice on
    windows it never saw better than the untrained head's."""
    from accelgen.cli.datastore import dataset_texts

    model, tokenizer = smollm
    windows = packed_windows(tokenizer, dataset_texts("sharegpt"), seq_len=64, count=24)
    features, choices = collect_features(model, windows)
    held, train = slice(0, 8), slice(8, None)
    before = evaluate_eagle(model, new_head(model), windows[held], features[held], choices[held])
    head, _ = train_eagle(model, windows[train], features[train], choices[train],
                          EagleConfig(steps=25, batch_size=4, learning_rate=1e-3, draft_vocab=0))
    after = evaluate_eagle(model, head, windows[held], features[held], choices[held])
    assert after["top1"] > before["top1"] + 0.05 and after["top5"] >= after["top1"], (before, after)


def test_checkpoints_resume(tiny_target, data, tmp_path):
    windows, features, choices = data
    _, first = train_eagle(tiny_target, windows, features, choices, EagleConfig(steps=4, checkpoint_every=2, **SMALL),
                           tmp_path)
    _, second = train_eagle(tiny_target, windows, features, choices, EagleConfig(steps=6, checkpoint_every=2, **SMALL),
                            tmp_path)
    assert (first["resumed_at"], second["resumed_at"]) == (0, 4)
    assert torch.load(tmp_path / eagle.CHECKPOINT, weights_only=True)["step"] == 6
    with pytest.raises(ValueError, match="other settings"):
        train_eagle(tiny_target, windows, features, choices, EagleConfig(steps=8, checkpoint_every=2,
                                                                         **{**SMALL, "learning_rate": 0.5}), tmp_path)


def test_the_command_trains_a_head_that_generate_uses(command_inputs, tokenizer, tmp_path):
    folder, dataset = command_inputs(seed=0)
    out = tmp_path / "eagle"
    run = CliRunner().invoke(app, ["train", "eagle", "--model", str(folder), "--dataset", dataset, "--out", str(out),
                                   "--windows", "8", "--held-out", "2", "--seq-len", "16", "--steps", "6",
                                   "--draft-vocab", "512"])
    assert run.exit_code == 0, run.output
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert evaluation["draft_vocab"] == 512 and 0 <= evaluation["top1"] <= evaluation["top5"] <= 1
    assert (out / "features" / "last-hidden").is_dir() and (out / eagle.CHECKPOINT).exists()  # the feature store
    runs = [CliRunner().invoke(app, ["generate", "def add(a, b):", "--model", str(folder), "-n", "10", "--json",
                                     *extra]) for extra in ([], ["--method", "eagle", "--head", str(out)])]
    assert all(result.exit_code == 0 for result in runs), runs[1].output
    plain, drafted = (json.loads(result.stdout.strip().splitlines()[-1]) for result in runs)
    assert drafted["token_ids"] == plain["token_ids"]


# --- the EAGLE-3 recipe ----------------------------------------------------------------------------------------

from accelgen.heads.eagle3 import new_eagle3_head
from accelgen.models.block import Block
from accelgen.train.curves import CURVE_JSON
from accelgen.train.eagle import collect_layer_states, target_layers_for, ttt_loss


@pytest.fixture(scope="module")
def four_layers(make_tiny_model):
    return make_tiny_model("qwen2", seed=0, layers=4)


def test_the_unrolled_loss_matches_a_hand_computed_two_step_loss(four_layers):
    """Training-time test over two steps equals, term by term, what the head computes when it drafts: step 0 is
    the head over the true pairs; step 1 at position t is a plain causal run over the true pairs 0..t followed by
    (x_{t+2}, the head's own step-0 output at t) at position t + 1, taught the target's choice after x_{t+2}."""
    model = four_layers
    windows = torch.randint(0, 49152, (2, 9), generator=torch.Generator().manual_seed(1))
    layers = target_layers_for(model)
    states, choices = collect_layer_states(model, windows, layers)
    vocab = torch.cat([torch.unique(choices[:, ::2]), torch.tensor([0])]).unique()  # some choices left out
    head = new_eagle3_head(model, vocab, layers)
    with torch.no_grad():  # away from the identity start, so that every part of the layer counts
        for parameter in head.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    labels = head.label_index(choices)
    embeds = model.get_input_embeddings()(windows[:, 1:]).float()
    loss, _ = ttt_loss(head, embeds, states.float(), labels, steps=2, decay=0.8)

    length = windows.shape[1] - 1
    fused = head.fuse(states[:, :-1].float())
    terms: dict[int, list] = {0: [], 1: []}
    with torch.no_grad():
        for row in range(len(windows)):
            chain = Block.chain(0, length)
            step0 = head(embeds[row : row + 1], fused[row : row + 1], chain.positions[None],
                         chain.mask(torch.float32, "cpu"))[0]
            for t in range(length):
                terms[0].append((head.draft_logits(step0[t]), labels[row, t + 1]))
                if t + 2 <= length:
                    pairs = Block.chain(0, t + 2)
                    output = head(embeds[row : row + 1, : t + 2], torch.cat([fused[row, : t + 1], step0[t : t + 1]])[None],
                                  pairs.positions[None], pairs.mask(torch.float32, "cpu"))[0, -1]
                    terms[1].append((head.draft_logits(output), labels[row, t + 2]))

    def mean_cross_entropy(pairs):
        kept = [(logits, goal) for logits, goal in pairs if goal != -100]
        assert 0 < len(kept) < len(pairs)  # some labels count, some lie outside the draft vocabulary
        return torch.stack([torch.nn.functional.cross_entropy(logits[None], goal[None]) for logits, goal in kept]).mean()

    expected = mean_cross_entropy(terms[0]) + 0.8 * mean_cross_entropy(terms[1])
    assert torch.allclose(loss.detach(), expected, atol=1e-5), (float(loss), float(expected))


def test_eagle3_training_learns_the_targets_choices_at_every_unrolled_depth(four_layers, tokenizer,
                                                                          own_continuations):
    model = four_layers
    prompt = [5, 17, 923, 4410, 77, 12]
    texts = [tokenizer.decode(prompt + tokens) for tokens in
             own_continuations(model, tokenizer, [[start] + prompt[1:] for start in range(5, 17)], 40)]
    windows = packed_windows(tokenizer, texts, seq_len=32, count=12)
    states, choices = collect_layer_states(model, windows, target_layers_for(model))
    config = EagleConfig(steps=30, batch_size=8, learning_rate=1e-2, draft_vocab=2048, recipe="eagle3", ttt_steps=3)
    rows = []
    head, _ = train_eagle(model, windows, states, choices, config, progress=rows.append)
    evaluation = evaluate_eagle(model, head, windows, states, choices)
    assert rows[-1]["loss"] < rows[0]["loss"] / 3
    assert min(evaluation["top1_per_depth"][:3]) > 0.5 and evaluation["recipe"] == "eagle3", evaluation
    assert evaluation["draft_vocab"] == 2048 and evaluation["choices_in_draft_vocab"] == 1.0


def test_recipe_settings_are_checked():
    with pytest.raises(ValueError, match="recipe must be one of eagle1, eagle3"):
        EagleConfig(recipe="eagle2")
    with pytest.raises(ValueError, match="ttt_steps must be >= 1"):
        EagleConfig(recipe="eagle3", ttt_steps=0)


def test_the_command_trains_an_eagle3_head_with_a_learning_curve(command_inputs, tmp_path):
    folder, dataset = command_inputs(seed=0, layers=4)
    out = tmp_path / "eagle3"
    run = CliRunner().invoke(app, ["train", "eagle", "--recipe", "eagle3", "--ttt-steps", "2", "--model", str(folder),
                                   "--dataset", dataset, "--out", str(out), "--windows", "8", "--held-out", "2",
                                   "--seq-len", "16", "--steps", "4", "--draft-vocab", "512", "--eval-every", "2"])
    assert run.exit_code == 0, run.output
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert evaluation["recipe"] == "eagle3" and evaluation["draft_vocab"] == 512
    curve = json.loads((out / CURVE_JSON).read_text())
    assert [point["step"] for point in curve["points"]] == [0, 2, 4]
    assert [point["tokens"] for point in curve["points"]] == [0, 2 * 4 * 15, 4 * 4 * 15]  # batch 4, 15 positions
    assert all(len(point["top1_per_depth"]) == 5 and point["tau"] >= 1 for point in curve["points"])
    assert (out / "curve.png").exists() and (out / "features" / "layer-states").is_dir()  # three layers' states
    runs = [CliRunner().invoke(app, ["generate", "def add(a, b):", "--model", str(folder), "-n", "10", "--json",
                                     *extra]) for extra in ([], ["--method", "eagle", "--head", str(out)])]
    assert all(result.exit_code == 0 for result in runs), runs[1].output
    plain, drafted = (json.loads(result.stdout.strip().splitlines()[-1]) for result in runs)
    assert drafted["token_ids"] == plain["token_ids"]


# --- going on from a trained head (--resume-from): weights kept, a fresh optimizer, the curve continued ----------

from accelgen.train.eagle import load_start_head


@pytest.fixture(scope="module")
def eagle3_data(four_layers, tokenizer, own_continuations):
    """(windows, states, choices) of the four-layer target's own greedy text: 12 windows of 32 tokens."""
    prompt = [5, 17, 923, 4410, 77, 12]
    texts = [tokenizer.decode(prompt + tokens) for tokens in
             own_continuations(four_layers, tokenizer, [[start] + prompt[1:] for start in range(5, 17)], 40)]
    windows = packed_windows(tokenizer, texts, seq_len=32, count=12)
    return (windows, *collect_layer_states(four_layers, windows, target_layers_for(four_layers)))


def test_a_resumed_head_starts_where_its_training_ended(four_layers, eagle3_data, tmp_path):
    """Trained, saved and trained further with a fresh optimizer: the further run's first loss is the trained head's
    (near the first run's last), not a new head's; the draft vocabulary is the saved head's."""
    windows, states, choices = eagle3_data
    config = EagleConfig(steps=30, batch_size=12, learning_rate=1e-2, draft_vocab=2048, recipe="eagle3", ttt_steps=2)
    first = []
    head, _ = train_eagle(four_layers, windows, states, choices, config, progress=first.append)
    head.save(tmp_path / "trained")
    resumed_config = EagleConfig(**{**config.__dict__, "steps": 3, "warmup_steps": 3})
    start = load_start_head(tmp_path / "trained", four_layers, resumed_config)
    assert torch.equal(start.d2t, head.d2t) and start.fc.weight.dtype == torch.float32
    further = []
    train_eagle(four_layers, windows, states, choices, resumed_config, progress=further.append, start_head=start)
    # every window in every batch (batch 12 of 12 windows): the losses compare the same data
    assert first[0]["loss"] > 3 * first[-1]["loss"]
    assert further[0]["loss"] < 1.2 * first[-1]["loss"], (first[-1], further[0])


def test_a_head_that_cannot_go_on_for_this_model_is_refused_by_name(four_layers, tiny_target, eagle3_data, tmp_path):
    windows, states, choices = eagle3_data
    config = EagleConfig(steps=1, batch_size=4, draft_vocab=512, recipe="eagle3", ttt_steps=1)
    head, _ = train_eagle(four_layers, windows, states, choices, config)
    head.save(tmp_path / "trained")
    with pytest.raises(ValueError, match="do not fit this model: layer count 4, the model's is 2"):
        load_start_head(tmp_path / "trained", tiny_target, config)
    with pytest.raises(ValueError, match="is an eagle3 head; resume it with --recipe eagle3"):
        load_start_head(tmp_path / "trained", four_layers, EagleConfig(recipe="eagle1"))
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        EagleConfig(warmup_steps=-1)


def test_the_command_goes_on_from_a_head_and_continues_its_learning_curve(command_inputs, tmp_path):
    folder, dataset = command_inputs(seed=0, layers=4)
    common = ["train", "eagle", "--recipe", "eagle3", "--ttt-steps", "2", "--model", str(folder), "--dataset", dataset,
              "--windows", "8", "--held-out", "2", "--seq-len", "16", "--draft-vocab", "512", "--eval-every", "2",
              "--features", str(tmp_path / "features")]
    first, further = tmp_path / "first", tmp_path / "further"
    run = CliRunner().invoke(app, [*common, "--out", str(first), "--steps", "2"])
    assert run.exit_code == 0, run.output
    run = CliRunner().invoke(app, [*common, "--out", str(further), "--steps", "4", "--resume-from", str(first),
                                   "--warmup-steps", "2"])
    assert run.exit_code == 0, run.output
    curve = json.loads((further / CURVE_JSON).read_text())
    assert [(point["session"], point["step"], point["tokens"]) for point in curve["points"]] == [
        (0, 0, 0), (0, 2, 120), (1, 0, 120), (1, 2, 240), (1, 4, 360)]  # batch 4 × 15 positions a step
    # the resumed session starts with the first session's head
    assert curve["points"][2]["top1_per_depth"] == curve["points"][1]["top1_per_depth"]
    sessions = curve["sessions"]
    assert [session["tokens_seen"] for session in sessions] == [120, 360] and sessions[1]["resumed_from"] == "first"
    assert all("machine" in session and session["train_minutes"] >= 0 for session in sessions)
    same = CliRunner().invoke(app, [*common, "--out", str(first), "--resume-from", str(first)])
    assert same.exit_code == 2 and "the same folder" in same.output
