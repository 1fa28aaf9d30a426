"""The harness end to end on tiny random models: files written, a wrong method caught, resume, the CLI."""

from __future__ import annotations

import copy
import inspect
import json

import pytest
import torch
from typer.testing import CliRunner

import accelgen
import accelgen.registry
from accelgen.bench import report, rows, runner
from accelgen.bench.runner import BenchConfig
from accelgen.cli import app
from accelgen.draft import Draft
from accelgen.drafters.base import Drafter
from accelgen.registry import MethodSpec, Part

PNG_MAGIC = b"\x89PNG"
ALL_PEERS = ["hf-greedy", "hf-assisted", "hf-prompt-lookup", "autoregressive", "speculative"]


def bench(tmp_path, prompts_file, model, tokenizer, draft_model=None, out="out", **config):
    settings = {"model": "tiny", "dataset": f"jsonl:{prompts_file}", "draft": "tiny" if draft_model is not None else None,
                "max_new_tokens": 8, "warmup": False, **config}
    out_dir = tmp_path / out
    runner.run(runner.plan(BenchConfig(**settings)), model, tokenizer, out_dir, draft_model, command="accelgen bench test")
    return report.render(out_dir), out_dir


def test_bench_writes_results_report_and_plots(tmp_path, prompts_file, tiny_target, tokenizer):
    # the target drafting for itself: every draft token is accepted
    results, out_dir = bench(tmp_path, prompts_file, tiny_target, tokenizer, draft_model=tiny_target,
                             methods=ALL_PEERS, warmup=True, options={"speculative": {"gamma": 3}})
    assert json.loads((out_dir / "results.json").read_text()) == json.loads(json.dumps(results))
    meta = results["metadata"]
    assert meta["command"] == "accelgen bench test" and meta["dtype"] == "float32"
    assert meta["machine"]["torch_threads"] == 2 and meta["machine"]["cpu"] and meta["versions"]["transformers"]
    records = results["records"]
    assert len(records) == 2 * len(ALL_PEERS)
    assert {(r["prompt_id"], r["method"]) for r in records} == {(p, m) for p in ("code", "chat") for m in ALL_PEERS}
    for r in records:
        assert r["new_tokens"] == len(r["token_ids"]) and r["seconds"] > 0 and r["speedup"] > 0
        assert r["identical"] is True  # float32: every lossless method matches HF greedy exactly
        assert sum(r["committed_per_step"]) == r["new_tokens"]
        assert r["tau"] == pytest.approx(r["new_tokens"] / r["target_forwards"])
        assert r["dataset"] == f"jsonl:{prompts_file}" and r["category"] in ("coding", "writing")
    overall = results["aggregates"]["overall"]
    assert list(results["aggregates"]) == ["overall", "coding", "writing"]
    assert overall["hf-greedy"]["tau"] == 1.0 and overall["autoregressive"]["tau"] == 1.0
    assert overall["speculative"]["acceptance_rate"] == 1.0 and overall["speculative"]["tau"] > 2
    assert overall["hf-assisted"]["tau"] > 1 and overall["hf-assisted"]["draft_share"] > 0
    assert results["warnings"] == [] and results["audits"] == []
    assert [row["gamma"] for row in results["theory"]] == [3, 3]
    assert results["cost"]["cost_ratio"] > 0
    markdown = (out_dir / "report.md").read_text()
    for heading in ("## Overall", "## Category: coding", "## Category: writing", "## Divergence audit", "## Theory check"):
        assert heading in markdown
    for plot in ("speedup.png", "tau.png"):
        assert (out_dir / plot).read_bytes()[:4] == PNG_MAGIC


FAVOURITE_TOKEN = 42


class FavouriteTokenDrafter(Drafter):
    """Drafts nothing, but while the target scores each step it boosts one token: a stand-in for a buggy method."""

    def __init__(self, target_model):
        self.target_model = target_model
        self.handle = None

    def propose(self, context, max_nodes):
        self.handle = self.target_model.register_forward_hook(boost_favourite)
        return Draft.empty()

    def update(self, draft, verdict, target_logits):
        self.handle.remove()


def boost_favourite(module, args, output):
    output.logits[..., FAVOURITE_TOKEN] += 1000.0
    return output


def register_wrong_method(monkeypatch) -> str:
    """Register a method that breaks its lossless claim, until `monkeypatch` is undone; returns its name."""
    accelgen.registry.list_methods()  # load the built-in methods first
    spec = MethodSpec(name="bench-test-wrong", family="speculative", lossless="greedy-exact", paper="-",
                      summary="claims greedy-exact, is not",
                      drafter=Part(lambda build, options: FavouriteTokenDrafter(build.target_model)))
    monkeypatch.setitem(accelgen.registry._METHODS, spec.name, spec)  # removed again after the test
    return spec.name


@pytest.fixture
def wrong_method(monkeypatch):
    return register_wrong_method(monkeypatch)


def test_wrong_method_is_caught_and_audited(tmp_path, prompts_file, tiny_target, tokenizer, wrong_method):
    results, out_dir = bench(tmp_path, prompts_file, tiny_target, tokenizer, methods=["autoregressive", wrong_method])
    overall = results["aggregates"]["overall"]
    assert overall["autoregressive"]["identical"] == 2
    assert overall[wrong_method]["identical"] == 0 and overall[wrong_method]["mismatched_prompts"] == ["code", "chat"]
    assert {(a["method"], a["classification"]) for a in results["audits"]} == {(wrong_method, "error")}
    assert all(a["method_token"] == FAVOURITE_TOKEN and a["position"] == 0 for a in results["audits"])
    [warning] = results["warnings"]
    assert warning["method"] == wrong_method and warning["severity"] == "error" and warning["errors"] == ["code", "chat"]
    assert f"**LOSSLESS VIOLATION** {wrong_method}" in (out_dir / "report.md").read_text()


def test_wrong_method_is_gone_after_the_test():
    def listed() -> set[str]:
        return {spec.name for spec in accelgen.registry.list_methods()}

    with pytest.MonkeyPatch.context() as monkeypatch:  # what the fixture's monkeypatch does around a test
        name = register_wrong_method(monkeypatch)
        assert name in listed()
    assert name not in listed()


class Interrupt(Exception):
    pass


def test_resume_continues_from_saved_records(tmp_path, prompts_file, tiny_target, tiny_draft, tokenizer):
    config = BenchConfig(model="tiny", dataset=f"jsonl:{prompts_file}", draft="tiny", max_new_tokens=6, warmup=False,
                         methods=["hf-greedy", "autoregressive", "speculative"])
    out_dir = tmp_path / "resumable"

    def interrupt_after_two(record, records):
        if len(records) == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        runner.run(runner.plan(config), tiny_target, tokenizer, out_dir, tiny_draft, progress=interrupt_after_two)
    with open(out_dir / "records.jsonl", "a") as f:
        f.write('{"prompt_id": "cut off mid-li')  # what a kill while writing leaves behind
    seen = []
    runner.run(runner.plan(config), tiny_target, tokenizer, out_dir, tiny_draft, progress=lambda r, rs: seen.append(r))
    records = runner.read_jsonl(out_dir / "records.jsonl")
    assert len(seen) == 4 and len(records) == 6
    assert len({(r["prompt_id"], r["method"]) for r in records}) == 6
    assert len(json.loads((out_dir / "run.json").read_text())["resumed"]) == 1

    changed = BenchConfig(**{**config.__dict__, "max_new_tokens": 7})
    with pytest.raises(ValueError, match="different configuration .*max_new_tokens"):
        runner.run(runner.plan(changed), tiny_target, tokenizer, out_dir, tiny_draft)
    runner.run(runner.plan(changed), tiny_target, tokenizer, out_dir, tiny_draft, overwrite=True)
    assert len(runner.read_jsonl(out_dir / "records.jsonl")) == 6


def test_sampling_run_reports_speed_and_tau_only(tmp_path, prompts_file, tiny_target, tiny_draft, tokenizer):
    results, out_dir = bench(tmp_path, prompts_file, tiny_target, tokenizer, draft_model=tiny_draft,
                             methods=["speculative"], temperature=0.8, max_new_tokens=4, limit=1)
    assert all(r["identical"] is None for r in results["records"])
    assert results["warnings"] == [] and not (out_dir / "audits.jsonl").exists()
    assert "sampling run" in (out_dir / "report.md").read_text()


def test_method_order_is_shuffled_per_prompt_and_reproducible():
    methods = list("abcdef")
    orders = [runner.shuffled(methods, index) for index in range(20)]
    assert all(sorted(order) == methods for order in orders)
    assert orders == [runner.shuffled(methods, index) for index in range(20)]
    assert len({order[0] for order in orders}) > 3  # not always the same method first
    followers_of_a = {order[order.index("a") + 1] for order in orders if order[-1] != "a"}
    assert len(followers_of_a) > 1  # unlike a rotation, neighbours change


def test_resolve_methods():
    default, notes = rows.resolve_methods(None, resources=set(), temperature=0)
    names = [m.name for m in default]
    assert names[0] == "hf-greedy" and "hf-prompt-lookup" in names and "autoregressive" in names
    assert "speculative" not in names and any("skipping speculative: needs draft_model" in n for n in notes)
    chosen, notes = rows.resolve_methods(["speculative"], {"draft_model"}, 0)
    assert [m.name for m in chosen] == ["hf-greedy", "speculative"] and "added hf-greedy" in notes[0]
    with pytest.raises(ValueError, match="unknown method 'warp-drive'"):
        rows.resolve_methods(["warp-drive"], set(), 0)
    with pytest.raises(ValueError, match="'speculative' needs draft_model"):
        rows.resolve_methods(["speculative"], set(), 0)
    with pytest.raises(ValueError, match="'consistent-ee' needs heads"):
        rows.resolve_methods(["consistent-ee"], set(), 0)
    for given in (["consistent-ee@heads=policy"], ["consistent-ee"]):  # in the variant's name, or with -o
        chosen, _ = rows.resolve_methods(given, set(), 0, {} if "@" in given[0] else {"consistent-ee": {"heads": "p"}})
        assert chosen[1].name == given[0]
    with pytest.raises(ValueError, match="options given for 'speculative'"):
        rows.resolve_methods(["autoregressive"], set(), 0, {"speculative": {"gamma": 3}})


def test_a_head_shipped_for_the_runs_model_meets_its_methods_need():
    from accelgen.bench.runner import shipped_heads

    assert shipped_heads("smollm2-135m") == {"heads:eagle"} and shipped_heads("some/model") == set()
    chosen, _ = rows.resolve_methods(["eagle"], shipped_heads("smollm2-135m"), 0)
    assert [m.name for m in chosen] == ["hf-greedy", "eagle"]
    with pytest.raises(ValueError, match="'medusa' needs heads"):  # no Medusa heads ship
        rows.resolve_methods(["medusa"], shipped_heads("smollm2-135m"), 0)
    with pytest.raises(ValueError, match="'eagle' needs heads"):
        rows.resolve_methods(["eagle"], shipped_heads("qwen2.5-coder-1.5b"), 0)


def test_variants_sweep_a_lossy_method_in_one_run(tmp_path, prompts_file, tiny_target, tiny_draft, tokenizer):
    sweep = ["specdec@beta=1", "specdec@beta=49152+tau=1000", "speculative@gamma=2"]
    results, out_dir = bench(tmp_path, prompts_file, tiny_target, tokenizer, draft_model=tiny_draft, methods=sweep)
    assert results["config"]["methods"] == ["hf-greedy", *sweep]
    assert results["config"]["options"]["specdec@beta=49152+tau=1000"] == {"gamma": 5, "beta": 49152, "tau": 1000}
    overall = results["aggregates"]["overall"]
    assert overall["specdec@beta=1"]["identical"] == 2  # beta 1 is greedy verification
    assert overall["specdec@beta=49152+tau=1000"]["agreement"] < 1  # accepts every draft token
    assert overall["specdec@beta=49152+tau=1000"]["tau"] > overall["specdec@beta=1"]["tau"]
    assert {row["gamma"] for row in results["theory"] if row["method"] == "speculative@gamma=2"} == {2}
    assert (out_dir / "tradeoff.png").read_bytes()[:4] == PNG_MAGIC
    assert "tradeoff.png" in (out_dir / "report.md").read_text()


def test_a_variant_brings_its_own_draft_model(tmp_path, prompts_file, tiny_target, tiny_draft, tokenizer):
    """speculative@draft=FOLDER drafts with the model in FOLDER (here the target itself: every draft accepted),
    beside a row drafting with the run's --draft (a random model: hardly any accepted)."""
    tiny_target.save_pretrained(tmp_path / "own")
    own = f"speculative@draft={tmp_path / 'own'}"
    results, _ = bench(tmp_path, prompts_file, tiny_target, tokenizer, draft_model=tiny_draft,
                       methods=["speculative", own], options={"speculative": {"gamma": 4}})  # drafts of a fixed length
    overall = results["aggregates"]["overall"]
    assert overall[own]["acceptance_rate"] == 1.0 > overall["speculative"]["acceptance_rate"]
    assert overall[own]["identical"] == overall["speculative"]["identical"] == 2
    alone, _ = rows.resolve_methods([own], set(), 0)  # its own draft meets the need without --draft
    assert alone[1].draft == str(tmp_path / "own")


def test_options_for_a_method_reach_its_variants_unless_they_set_them():
    """-o rest.datastore=PATH serves every rest row; a variant's own value wins over -o for its method."""
    given = {"specdec": {"beta": 7, "tau": 0.5}}
    chosen, _ = rows.resolve_methods(["specdec", "specdec@beta=2"], {"draft_model"}, 0, given)
    plain, swept = chosen[1:]
    assert plain.check_options(plain.given_options(given))["beta"] == 7
    assert swept.check_options(swept.given_options(given)) == {"gamma": 5, "beta": 2, "tau": 0.5}
    needs_store, _ = rows.resolve_methods(["rest@max_nodes=8"], set(), 0, {"rest": {"datastore": "store"}})
    assert needs_store[1].given_options({"rest": {"datastore": "store"}}) == {"datastore": "store"}
    with pytest.raises(ValueError, match="needs datastore"):
        rows.resolve_methods(["rest@max_nodes=8"], set(), 0)


@pytest.mark.parametrize("name, message", [("specdec@beta", "name=value"), ("specdec@warp=1", "has no option 'warp'"),
                                           ("warp@beta=1", "unknown method 'warp'"),
                                           ("pld@draft=folder", "pld takes no draft model")])
def test_bad_variants_are_named(name, message):
    with pytest.raises(ValueError, match=message):
        rows.resolve_methods([name], {"draft_model"}, 0)


def test_llma_copies_from_the_prompt_when_no_references_are_given(smollm):
    model, tokenizer = smollm
    chosen, _ = rows.resolve_methods(["llma"], runner.PROMPT_RESOURCES, 0)
    llma = chosen[1]
    prompt_ids = tokenizer("one two three four five six seven eight nine ten. one two three four five six").input_ids
    record = rows.run_accelgen(llma, model, tokenizer, prompt_ids, draft_model=None, max_new_tokens=6,
                                  temperature=0, seed=0, options=llma.check_options({}))
    assert record["accepted_draft_tokens"] > 0 and record["target_forwards"] < 6


@pytest.mark.parametrize("with_draft, chosen", [(True, "speculative"), (False, "pld")])
def test_auto_gets_the_runs_draft_model(tiny_target, tiny_draft, tokenizer, measured_costs, with_draft, chosen):
    """`auto` needs no draft model but uses one when the run has it (uncalibrated, with a draft that costs little
    and verification as cheap as decoding: speculation with it)."""
    measured_costs({tiny_target: (0.01, {1: 1.0}), tiny_draft: (0.0001, {1: 1.0})})
    auto = rows.resolve_methods(["auto"], runner.PROMPT_RESOURCES, 0)[0][1]
    record = rows.run_accelgen(auto, tiny_target, tokenizer, [5, 17, 923], draft_model=tiny_draft if with_draft else None,
                                  max_new_tokens=4, temperature=0, seed=0, options=auto.check_options({}))
    assert record["choice"]["method"] == chosen


def test_hf_committed_per_step_from_cache_lengths():
    counter = rows.ForwardCounter.__new__(rows.ForwardCounter)
    # prompt of 10: the prefill forward verifies one candidate, later forwards start at cache lengths 11, 13
    counter.forwards, counter.cache_lengths = 3, [0, 11, 13]
    assert counter.committed_per_step(prompt_length=10, new_tokens=6) == [2, 2, 2]
    counter.cache_lengths = [0, None, 13]
    assert counter.committed_per_step(10, 6) is None


def test_variant_values_follow_the_option_type():
    from accelgen.bench.rows import available_methods, variant

    assert variant(available_methods(), "auto@workload=2024").options["workload"] == "2024"


@pytest.mark.parametrize("arguments, message", [
    (["--dataset", "nope"], "unknown dataset"),
    (["--dataset", "humaneval", "--methods", "warp-drive"], "unknown method"),
    (["--dataset", "humaneval", "--methods", "speculative"], "needs draft_model"),
    (["--dataset", "jsonl:absent.jsonl"], "dataset file not found"),
    (["--dataset", "humaneval", "-o", "autoregressive.gamma=3"], "has no option 'gamma'"),
])
def test_bench_cli_rejects_bad_input_before_loading_models(arguments, message):
    result = CliRunner().invoke(app, ["bench", "--model", "no-such-model", *arguments])
    assert result.exit_code == 2 and message in result.output


def test_bench_report_rerenders_saved_results(tmp_path, prompts_file, tiny_target, tokenizer):
    _, out_dir = bench(tmp_path, prompts_file, tiny_target, tokenizer, methods=["hf-greedy"], limit=1)
    for name in ("results.json", "report.md", "speedup.png", "tau.png"):
        (out_dir / name).unlink()
    result = CliRunner().invoke(app, ["bench-report", str(out_dir)])
    assert result.exit_code == 0, result.output
    assert all((out_dir / name).exists() for name in ("results.json", "report.md", "speedup.png", "tau.png"))
    missing = CliRunner().invoke(app, ["bench-report", str(tmp_path / "nothing-here")])
    assert missing.exit_code == 2 and "not a benchmark folder" in missing.output


def test_weight_format_variants_and_llamacpp_rows_are_parsed():
    chosen, _ = rows.resolve_methods(["autoregressive@weights=int8", "speculative@weights=gguf+draft_weights=int4",
                                         "pld@draft_budget=measured", "llamacpp", "llamacpp-draft"],
                                        {"draft_model"}, 0)
    by_name = {m.name: m for m in chosen}
    assert by_name["autoregressive@weights=int8"].weights == "int8"
    assert (by_name["speculative@weights=gguf+draft_weights=int4"].weights,
            by_name["speculative@weights=gguf+draft_weights=int4"].draft_weights) == ("gguf", "int4")
    assert by_name["pld@draft_budget=measured"].check_options({})["draft_budget"] == "measured"
    assert by_name["llamacpp"].source == "llamacpp" and by_name["llamacpp"].weights == "gguf"
    with pytest.raises(ValueError, match="unknown weights format"):
        rows.resolve_methods(["pld@weights=int3"], set(), 0)


def test_rows_in_their_own_format_are_checked_against_that_formats_autoregressive(tmp_path, prompts_file, tiny_target,
                                                                                tokenizer, monkeypatch):
    """weights=int8 rows run a quantized copy of the target (loaded once, shared by the rows of that format) and are
    compared with autoregressive@weights=int8; draft_weights=int4 gives a row's draft a format of its own."""
    from accelgen.models.formats import quantize

    assert "weights" in inspect.signature(accelgen.load_model).parameters
    loaded = []

    def load_quantized(name, dtype=None, weights=None, threads=None, device=None):  # "tiny": quantize a copy
        assert device == "cpu"  # the run's own device
        loaded.append((name, weights))
        model = copy.deepcopy(tiny_target)
        quantize(model, weights)
        return model, tokenizer

    monkeypatch.setattr(runner, "load_model", load_quantized)
    results, out_dir = bench(tmp_path, prompts_file, tiny_target, tokenizer, draft_model=tiny_target,
                             methods=["autoregressive", "autoregressive@weights=int8", "speculative@weights=int8",
                                      "speculative@weights=int8+draft_weights=int4"])
    assert loaded == [("tiny", "int8"), ("tiny", "int4")]
    overall = results["aggregates"]["overall"]
    assert overall["speculative@weights=int8"]["weights"] == "int8"
    assert overall["speculative@weights=int8"]["draft_weights"] == "fp32"
    assert overall["speculative@weights=int8+draft_weights=int4"]["draft_weights"] == "int4"
    assert overall["speculative@weights=int8+draft_weights=int4"]["identical"] == 2  # the draft's format never matters
    assert overall["speculative@weights=int8"]["reference"] == "autoregressive@weights=int8"
    assert overall["speculative@weights=int8"]["identical"] == 2
    assert overall["speculative@weights=int8"]["format_speedup_total"] is not None
    report_text = (out_dir / "report.md").read_text()
    assert "flags:" in report_text and "vs autoregressive, same weights" in report_text


def test_the_run_records_its_device_and_resumes_a_run_saved_before_there_was_one(tmp_path, prompts_file, tiny_target,
                                                                                  tokenizer):
    results, out_dir = bench(tmp_path, prompts_file, tiny_target, tokenizer, methods=["hf-greedy"], limit=1)
    assert results["metadata"]["device"] == {"type": "cpu"} and results["config"]["device"] == "cpu"
    assert "- device:" not in (out_dir / "report.md").read_text()  # a CPU run is described by its machine line
    saved = json.loads((out_dir / "run.json").read_text())
    del saved["config"]["device"]  # as written before --device existed: those runs ran on the CPU
    (out_dir / "run.json").write_text(json.dumps(saved))
    config = BenchConfig(model="tiny", dataset=f"jsonl:{prompts_file}", methods=["hf-greedy"], limit=1,
                         max_new_tokens=8, warmup=False, device="cpu")
    runner.run(runner.plan(config), tiny_target, tokenizer, out_dir)  # resumed, not refused
    assert len(json.loads((out_dir / "run.json").read_text())["resumed"]) == 1


def test_a_bad_device_is_refused_before_anything_loads(prompts_file):
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        runner.plan(BenchConfig(model="tiny", dataset=f"jsonl:{prompts_file}", device="gpu"))


def test_models_on_another_device_than_the_runs_are_refused():
    from types import SimpleNamespace

    config = BenchConfig(model="tiny", dataset="humaneval")
    elsewhere = SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"the draft model is on cuda:0 but the run's device is cpu: load it there"):
        runner.check_devices(config, SimpleNamespace(device=torch.device("cpu")), elsewhere)


def test_a_gpu_run_leaves_out_llamacpps_cpu_rows(prompts_file, monkeypatch):
    monkeypatch.setattr(runner, "resolve_device", lambda device: torch.device("cuda", 0))  # as if on a GPU machine
    monkeypatch.setattr(runner, "resolve_methods", lambda *args: (
        [rows.HF_METHODS["hf-greedy"], rows.LLAMACPP_METHODS["llamacpp"]], []))
    plan = runner.plan(BenchConfig(model="tiny", dataset=f"jsonl:{prompts_file}", device="cuda"))
    assert [m.name for m in plan.methods] == ["hf-greedy"]
    assert plan.notes == ["skipping llamacpp: llama.cpp runs on the CPU only, this run on cuda"]
    with pytest.raises(ValueError, match="llamacpp runs on llama.cpp's CPU engine only, not on cuda: leave it out"):
        runner.plan(BenchConfig(model="tiny", dataset=f"jsonl:{prompts_file}", device="cuda",
                                methods=["hf-greedy", "llamacpp"]))
    with pytest.raises(ValueError, match="weights=gguf runs on llama.cpp's CPU engine only"):
        runner.plan(BenchConfig(model="tiny", dataset=f"jsonl:{prompts_file}", device="cuda", weights="gguf"))
