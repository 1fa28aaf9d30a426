"""The benchmark loop: every method on prompt 1, then every method on prompt 2, ..., each record appended to
records.jsonl as it completes, so an interrupted run resumes where it stopped.

Files in the output folder:
    run.json        configuration, run metadata, measured forward costs (written first)
    records.jsonl   one line per (prompt, method) run
    audits.jsonl    one line per audited divergence (written after the loop)
    executions.jsonl  with --execute: one line per HumanEval completion run through its tests (after the loop)
    results.json, report.md, speedup.png, tau.png   rendered from the files above (accelgen.bench.report)
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from accelgen.atomic import write_json_atomically, write_text_atomically
from accelgen import hardware
from accelgen.bench import audit, llamacpp
from accelgen.datasets import Prompt, load_dataset, prompt_token_ids
from accelgen.bench.execution import execute_records
from accelgen.bench.rows import (BASELINE, PROMPT_RESOURCES, STATIC_ROWS, BenchMethod, resolve_methods, run_method,
                                 static_cache_length, static_path_refusal)
from accelgen.bench.metrics import compare_with_baseline
from accelgen.drafters.draft_tree import draft_weights_for
from accelgen.errors import InputError
from accelgen.heads.shipping import shipped_drafters
from accelgen.models.loading import check_weights, load_model, resolve_device
from accelgen.models.timing import forward_seconds

RUN_FILE, RECORDS_FILE, AUDITS_FILE, EXECUTIONS_FILE = "run.json", "records.jsonl", "audits.jsonl", "executions.jsonl"
ADDED_SETTINGS = {"device": "cpu"}  # settings a run saved before they existed had, to resume it
WARMUP_TOKENS = 8
COST_REPEATS = 5


@dataclass
class BenchConfig:
    """Everything that decides what is measured; a resumed run must match it exactly."""

    model: str
    dataset: str
    draft: str | None = None
    dtype: str | None = None
    draft_dtype: str | None = None
    weights: str | None = None  # the target's weight format for rows that set none (None: dtype decides)
    draft_weights: str | None = None
    methods: list[str] | None = None  # None: every method whose needs are met
    limit: int | None = None
    categories: list[str] | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    threads: int = 2
    prompt_format: str = "auto"
    options: dict[str, dict] = field(default_factory=dict)  # method -> {option: value}
    warmup: bool = True
    device: str = "cpu"  # where the target and every draft run: cpu, cuda, cuda:N or auto

    def validate(self) -> None:
        check_weights(self.weights)
        check_weights(self.draft_weights)
        resolve_device(self.device)  # a device that is not there, before any model loads
        if self.on_gpu and "gguf" in (self.weights, self.draft_weights):
            raise InputError(f"weights=gguf runs on llama.cpp's CPU engine only, not on {self.device}")
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.threads < 1:
            raise InputError(f"threads must be >= 1, got {self.threads}")
        if self.limit is not None and self.limit < 1:
            raise InputError(f"limit must be >= 1, got {self.limit}")

    @property
    def on_gpu(self) -> bool:
        return resolve_device(self.device).type != "cpu"


@dataclass
class Plan:
    """What a run will do, settled before any model is loaded (so bad input fails fast)."""

    config: BenchConfig
    prompts: list[Prompt]
    methods: list[BenchMethod]
    options: dict[str, dict]  # method -> full options (defaults overlaid with the user's)
    notes: list[str]
    gguf_files: dict = field(default_factory=dict)  # the GGUF files llama.cpp runs: {"target": name, "draft": names}


def shipped_heads(model: str) -> set[str]:
    """The run's resources from the heads the package ships for an embedded model: "heads:METHOD" for each."""
    return {f"heads:{method}" for method in shipped_drafters(model)}


def plan(config: BenchConfig) -> Plan:
    config.validate()
    resources = PROMPT_RESOURCES | ({"draft_model"} if config.draft else set()) | shipped_heads(config.model)
    methods, notes = resolve_methods(config.methods, resources, config.temperature, config.options)
    if config.on_gpu:
        methods, notes = without_cpu_rows(methods, notes, config)
    methods, notes = without_refused_static_rows(methods, notes)
    options = {m.name: m.check_options(m.given_options(config.options)) for m in methods}
    notes += static_compile_notes(methods, options, config)
    prompts = load_dataset(config.dataset, config.limit, config.categories)
    if not prompts:
        raise InputError(f"dataset {config.dataset!r} gave no prompts")
    return Plan(config, prompts, methods, options, notes, check_gguf(config, methods))


def without_cpu_rows(methods: list[BenchMethod], notes: list[str], config: BenchConfig) -> tuple[list, list[str]]:
    """A run on a GPU without llama.cpp's rows, which run on the CPU: named, they are an error; else left out."""
    cpu_rows = [m.name for m in methods if m.source == "llamacpp" or "gguf" in (m.weights, m.draft_weights)]
    if cpu_rows and config.methods is not None:
        raise InputError(f"{', '.join(cpu_rows)} run{'s' * (len(cpu_rows) == 1)} on llama.cpp's CPU engine only, "
                         f"not on {config.device}: leave {'it' if len(cpu_rows) == 1 else 'them'} out")
    skipped = [f"skipping {name}: llama.cpp runs on the CPU only, this run on {config.device}" for name in cpu_rows]
    return [m for m in methods if m.name not in cpu_rows], notes + skipped


def without_refused_static_rows(methods: list[BenchMethod], notes: list[str]) -> tuple[list, list[str]]:
    """The run without the HF static rows the installed transformers refuses, each named in a note (not an
    error: what HF's static path allows is itself a finding of the run)."""
    refused = {m.name: static_path_refusal(m) for m in methods}
    skipped = [f"skipping {name}: {reason}" for name, reason in refused.items() if reason]
    return [m for m in methods if not refused[m.name]], notes + skipped


def static_compile_notes(methods: list[BenchMethod], options: dict[str, dict], config: BenchConfig) -> list[str]:
    """What the HF static rows compile: transformers compiles generate()'s forward on a GPU only (compile=auto)."""
    rows = [m.name for m in methods if m.registered_name in STATIC_ROWS]
    if not rows:
        return []
    says = {"auto": "compiled by transformers (torch.compile, inductor, mode reduce-overhead)" if config.on_gpu else
            f"eager: transformers compiles its forward on a GPU only, not on {config.device} (compile=true forces it)",
            True: "compiled (compile=true)", False: "eager (compile=false)"}
    return [f"{name}: transformers' static cache, forward {says[options[name]['compile']]}" for name in rows]


def check_gguf(config: BenchConfig, methods: list[BenchMethod]) -> dict:
    """The GGUF files of the models that run on llama.cpp (its own rows, or weights=gguf, draft_weights=gguf),
    checked before any model is loaded: an HF folder has none, and llama.cpp's own rows need its package."""
    target = any((m.weights or config.weights) == "gguf" for m in methods)  # llama.cpp's rows are weights=gguf
    drafts = [m.draft or config.draft for m in methods if uses_draft(m) and (m.draft or config.draft)
              and (m.draft_weights or config.draft_weights) == "gguf"]
    if not target and not drafts:
        return {}
    return llamacpp.gguf_files(config.model if target else None, drafts,
                               peers=any(m.source == "llamacpp" for m in methods))


def uses_draft(method: BenchMethod) -> bool:
    return "draft_model" in method.needs or method.registered_name == "auto"  # auto may draft with the run's draft


def run(
    plan: Plan,
    model,
    tokenizer,
    out_dir: Path,
    draft_model=None,
    *,
    overwrite: bool = False,
    command: str | None = None,
    progress: Callable[[dict, list[dict]], None] | None = None,
    execute: bool = False,
) -> Path:
    """Run (or resume) the benchmark into out_dir; returns out_dir. progress(record, records) after each record."""
    config = plan.config
    check_devices(config, model, draft_model)
    torch.set_num_threads(config.threads)
    prompt_ids = [prompt_token_ids(tokenizer, p, config.prompt_format) for p in plan.prompts]
    identity = run_identity(plan, prompt_ids)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_info = open_run(out_dir, identity, overwrite)
    if run_info is None:
        run_info = {**identity, "metadata": {**describe_run(command, model, draft_model), "gguf_files": plan.gguf_files,
                                             "notes": plan.notes},
                    "cost": measure_costs(model, draft_model, prompt_ids[0])}
    else:
        run_info.setdefault("resumed", []).append({"date": now(), "command": command})
    write_json(out_dir / RUN_FILE, run_info)

    models = RowModels(plan, model, draft_model)
    cache_length = static_cache_length(max(map(len, prompt_ids)), config.max_new_tokens, plan.options)
    records = read_jsonl(out_dir / RECORDS_FILE)
    done = {(r["prompt_id"], r["method"]) for r in records}
    pending = [(i, m) for i in range(len(plan.prompts)) for m in shuffled(plan.methods, i)
               if (plan.prompts[i].id, m.name) not in done]
    if pending and config.warmup:
        for method in plan.methods:  # untimed: first calls pay for allocation and kernel selection
            generate(plan, method, models, tokenizer, prompt_ids[0], WARMUP_TOKENS, cache_length=cache_length)
    for index, method in pending:
        prompt = plan.prompts[index]
        record = generate(plan, method, models, tokenizer, prompt_ids[index], config.max_new_tokens,
                          seed=config.seed + index, cache_length=cache_length)
        record = {"prompt_id": prompt.id, "prompt_index": index, "category": prompt.category, "method": method.name,
                  "dataset": config.dataset, "prompt_tokens": len(prompt_ids[index]),
                  **models.formats(method), **references(plan, method, models), **record,
                  "tau": ratio_or_none(record["new_tokens"], record["target_forwards"]),
                  "acceptance_rate": ratio_or_none(record["accepted_draft_tokens"], record["draft_tokens"])}
        append_jsonl(out_dir / RECORDS_FILE, record)
        records.append(record)
        if progress:
            progress(record, records)

    if config.temperature == 0:
        audit_divergences(plan, models, tokenizer, prompt_ids, records, out_dir / AUDITS_FILE)
    if execute:
        execute_completions(records, tokenizer, out_dir / EXECUTIONS_FILE)
    return out_dir


def check_devices(config: BenchConfig, model, draft_model) -> None:
    """The models given are on the run's device (what run.json records, and where its other rows load)."""
    device = resolve_device(config.device)
    for what, each in (("target", model), ("draft model", draft_model)):
        if each is not None and torch.device(each.device) != device:
            raise InputError(f"the {what} is on {each.device} but the run's device is {device}: load it there "
                             f"(load_model(..., device={str(device)!r}))")


def generate(plan: Plan, method: BenchMethod, models: "RowModels", tokenizer, prompt_ids, max_new_tokens, seed=0,
             cache_length: int | None = None) -> dict:
    return run_method(method, models.target(method), tokenizer, prompt_ids, draft_model=models.draft(method),
                      max_new_tokens=max_new_tokens, temperature=plan.config.temperature, seed=seed,
                      options=plan.options[method.name], peers=models.peers, max_cache_len=cache_length)


class RowModels:
    """The models each row runs: the run's target and draft, or copies in a row's own weight format
    (variant options weights=, draft_weights=) or with a draft of its own (draft=PATH), each loaded once;
    and llama.cpp's servers for its peer rows."""

    def __init__(self, plan: Plan, model, draft_model):
        config = plan.config
        self.config = config
        self.main_weights = config.weights or model_format(model)
        self.targets = {self.main_weights: model}
        self.drafts = {(config.draft, config.draft_weights): draft_model}
        self.draft_keys: dict[str, tuple] = {}  # row -> (draft, weights), resolved once (draft_key)
        self.peers = None
        for method in plan.methods:
            if method.source == "llamacpp":
                if self.peers is None:
                    self.peers = llamacpp.LlamaCppPeers(config.model, config.draft, config.threads)
                continue
            weights = self.weights_of(method)
            if weights not in self.targets:
                self.targets[weights] = load_model(config.model, dtype=config.dtype, weights=weights,
                                                   threads=config.threads, device=config.device)[0]
            key = self.draft_key(method)
            if key[0] is not None and uses_draft(method) and key not in self.drafts:
                self.drafts[key] = load_model(key[0], dtype=config.draft_dtype, weights=key[1],
                                              threads=config.threads, device=config.device)[0]

    def weights_of(self, method: BenchMethod) -> str:
        return method.weights or self.main_weights

    def draft_key(self, method: BenchMethod) -> tuple:
        """(draft, weight format) of a row's draft; "auto" is a PyTorch format for a method that needs one."""
        if method.name not in self.draft_keys:
            draft, weights = method.draft or self.config.draft, method.draft_weights or self.config.draft_weights
            if method.source == "accelgen":
                weights = draft_weights_for([method.registered_name], draft, weights, device=self.config.device,
                                            threads=self.config.threads)
            self.draft_keys[method.name] = (draft, weights)
        return self.draft_keys[method.name]

    def target(self, method: BenchMethod):
        if method.source == "hf" and self.weights_of(method) == "gguf":
            raise InputError(f"{method.name} runs transformers' generate() and needs a PyTorch model, not weights=gguf")
        return self.targets.get(self.weights_of(method))

    def draft(self, method: BenchMethod):
        return self.drafts.get(self.draft_key(method), self.drafts[(self.config.draft, self.config.draft_weights)])

    def formats(self, method: BenchMethod) -> dict:
        """The weight formats a row ran, as loaded (weights=auto names what it chose): `weights`, and
        `draft_weights` for rows with a draft model."""
        if method.source == "llamacpp":
            return {"weights": "gguf", "draft_weights": "gguf" if uses_draft(method) else None}
        draft = self.draft(method) if uses_draft(method) else None
        return {"weights": model_format(self.target(method)),
                "draft_weights": model_format(draft) if draft is not None else None}


def references(plan: Plan, method: BenchMethod, models: RowModels) -> dict:
    """The rows a record is compared with: `reference` for identical output (hf-greedy in the run's own format;
    in another format the autoregressive row of that format, or for llama.cpp's rows its plain row) and
    `speed_reference` for the same-format speedup (the autoregressive row of its format). The plain-decoding
    rows of other formats are compared with hf-greedy for quality only (`quality_only`): agreement and ROUGE-L
    say what the format costs, and a difference there is no lossless violation."""
    names = {m.name: m for m in plan.methods}
    weights = models.weights_of(method)
    autoregressive = next((m.name for m in plan.methods if m.registered_name == "autoregressive"
                           and models.weights_of(m) == weights and m.source == "accelgen"), None)
    if weights == models.main_weights:
        reference = BASELINE
    elif method.name in (autoregressive, "llamacpp"):
        # another format is another model: its plain decoding against hf-greedy measures the format's quality cost
        return {"reference": BASELINE, "speed_reference": autoregressive, "quality_only": True}
    elif method.source == "llamacpp":
        reference = "llamacpp" if "llamacpp" in names else None
    else:
        reference = autoregressive
    return {"reference": reference, "speed_reference": autoregressive}


def model_format(model) -> str:
    from accelgen.costs import model_format as format_of

    return format_of(model)


def execute_completions(records: list[dict], tokenizer, path: Path) -> None:
    """HumanEval records' completions through the tests (bench/execution.py); cached in path."""
    done = {(row["prompt_id"], row["method"]) for row in read_jsonl(path)}
    for row in execute_records(records, tokenizer, done):
        append_jsonl(path, row)


def ratio_or_none(numerator, denominator) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def shuffled(methods: list, index: int) -> list:
    """The methods in a fixed random order per prompt (seeded by the prompt's index), so that no method always
    runs first, last, or right after the same other method (a rotation would keep the same neighbours)."""
    return random.Random(index).sample(methods, len(methods))


def run_identity(plan: Plan, prompt_ids: list[list[int]]) -> dict:
    """The configuration, resolved: what must match for records to be resumed."""
    fingerprint = hashlib.sha256(json.dumps([[p.id for p in plan.prompts], prompt_ids]).encode()).hexdigest()[:16]
    config = {**asdict(plan.config), "methods": [m.name for m in plan.methods], "options": plan.options,
              "device": str(resolve_device(plan.config.device))}  # the device "auto" or "cuda" meant
    del config["warmup"]  # does not change what is measured
    methods = {m.name: {"source": m.source, "family": m.family, "lossless": m.lossless, "needs": list(m.needs),
                        "summary": m.summary} for m in plan.methods}
    return {"config": json.loads(json.dumps(config)), "methods": methods, "prompts_fingerprint": fingerprint}


def open_run(out_dir: Path, identity: dict, overwrite: bool) -> dict | None:
    """The saved run.json if this run resumes it; None when starting afresh (old files removed on overwrite)."""
    path = out_dir / RUN_FILE
    if overwrite:
        for name in (RUN_FILE, RECORDS_FILE, AUDITS_FILE, EXECUTIONS_FILE):
            (out_dir / name).unlink(missing_ok=True)
        return None
    if not path.exists():
        if (out_dir / RECORDS_FILE).exists():
            raise InputError(f"{out_dir} holds records but no {RUN_FILE}; use --overwrite or another --out")
        return None
    saved = json.loads(path.read_text())
    differing = [key for key in identity["config"]
                 if saved["config"].get(key, ADDED_SETTINGS.get(key)) != identity["config"][key]]
    if saved.get("prompts_fingerprint") != identity["prompts_fingerprint"]:
        differing.append("prompts")
    if differing:
        raise InputError(f"{out_dir} holds a run with a different configuration ({', '.join(differing)}); "
                         "use --overwrite to replace it or another --out")
    return saved


def audit_divergences(plan: Plan, models: RowModels, tokenizer, prompt_ids: list[list[int]], records: list[dict],
                      path: Path) -> list[dict]:
    """Audit every divergence of a method that claims greedy-lossless output from its reference row (hf-greedy,
    or the autoregressive row of its weight format), with that format's model; cached in path."""
    audits = read_jsonl(path)
    audited = {(a["prompt_id"], a["method"]) for a in audits}
    methods = {m.name: m for m in plan.methods}
    lossless = {name for name, m in methods.items() if m.claims_lossless and name != BASELINE}
    index_of = {p.id: i for i, p in enumerate(plan.prompts)}
    for record in compare_with_baseline(records, greedy=True):
        key = (record["prompt_id"], record["method"])
        if (record["identical"] is not False or record["method"] not in lossless or key in audited
                or record.get("quality_only")):
            continue
        reference = next(r for r in records if r["prompt_id"] == record["prompt_id"]
                         and r["method"] == record.get("reference", BASELINE))
        model = models.targets.get(models.weights_of(methods[record["method"]]))
        if model is None:
            continue  # no model of this format in the run to recompute the logits with (llama.cpp rows alone)
        index = index_of[record["prompt_id"]]
        divergence = audit.audit(model, prompt_ids[index], reference["token_ids"], record["token_ids"])
        entry = {"prompt_id": record["prompt_id"], "method": record["method"], "category": record["category"],
                 "reference": reference["method"], **divergence.to_dict(), "dtype": audit.dtype_label(model),
                 "baseline_text": token_text(tokenizer, divergence.baseline_token),
                 "method_text": token_text(tokenizer, divergence.method_token)}
        append_jsonl(path, entry)
        audits.append(entry)
    return audits


def token_text(tokenizer, token: int | None) -> str | None:
    return None if token is None else tokenizer.decode([token])


def measure_costs(model, draft_model, prompt_ids: list[int]) -> dict:
    """Median time of one single-token forward (with a KV cache of the prompt) per model, and their ratio c."""
    target = forward_seconds(model, prompt_ids, repeats=COST_REPEATS)
    draft = forward_seconds(draft_model, prompt_ids, repeats=COST_REPEATS) if draft_model is not None else None
    return {"target_forward_seconds": target, "draft_forward_seconds": draft,
            "cost_ratio": draft / target if draft is not None and target > 0 else None}


def describe_run(command: str | None, model, draft_model) -> dict:
    import transformers

    return {
        "command": command,
        "date": now(),
        "machine": hardware.describe(),
        "device": hardware.describe_device(model.device),  # cpu, or the GPU with its CUDA and driver versions
        "versions": {"accelgen": importlib.metadata.version("accelgen"), "torch": torch.__version__, "transformers": transformers.__version__},
        "dtype": audit.dtype_name(model.dtype),
        "draft_dtype": audit.dtype_name(draft_model.dtype) if draft_model is not None else None,
        "weights": model_format(model),
        "draft_weights": model_format(draft_model) if draft_model is not None else None,
    }


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def read_jsonl(path: Path) -> list[dict]:
    """All complete lines; a line cut off by an interruption is dropped (and removed from the file)."""
    if not path.exists():
        return []
    text = path.read_text()
    complete, _, partial = text.rpartition("\n")
    if partial:
        write_text_atomically(path, complete + "\n" if complete else "")
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def append_jsonl(path: Path, item: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(item) + "\n")
        f.flush()


def write_json(path: Path, item: dict) -> None:
    write_json_atomically(path, item)
