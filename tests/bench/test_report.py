"""The report from saved files alone (no model): rows in several weight formats, and runs from before formats."""

from __future__ import annotations

import json

import pytest

from accelgen.bench import report

MACHINE = {"cpu": "AMD EPYC", "flags": ["avx2", "fma", "f16c"], "native_bf16": False, "logical_cores": 2,
           "torch_threads": 2, "system": "Linux x86_64", "python": "3.11"}
VERSIONS = {"accelgen": "0", "torch": "2", "transformers": "5"}
ROWS = {  # name: (source, weights, draft weights, reference, speed reference)
    "hf-greedy": ("hf", "bf16", None, "hf-greedy", "autoregressive"),
    "autoregressive": ("accelgen", "bf16", None, "hf-greedy", "autoregressive"),
    "autoregressive@weights=int8": ("accelgen", "int8", None, "hf-greedy", "autoregressive@weights=int8"),
    "speculative@weights=int8+draft_weights=int4": ("accelgen", "int8", "int4", "autoregressive@weights=int8",
                                                    "autoregressive@weights=int8"),
    "llamacpp": ("llamacpp", "gguf", None, "hf-greedy", None),
    "llamacpp-ngram": ("llamacpp", "gguf", None, "llamacpp", None),
}
SECONDS = {"hf-greedy": 8.0, "autoregressive": 10.0, "autoregressive@weights=int8": 4.0,
           "speculative@weights=int8+draft_weights=int4": 2.0, "llamacpp": 1.0, "llamacpp-ngram": 0.8}
TOKENS = {"hf-greedy": [1, 2, 3, 4], "autoregressive@weights=int8": [1, 2, 5, 6], "llamacpp": [1, 7, 7, 7],
          "llamacpp-ngram": [1, 7, 7, 8]}


def run_info(methods: list[str], metadata: dict) -> dict:
    return {"config": {"model": "m", "dataset": "specbench", "draft": "d", "temperature": 0.0, "max_new_tokens": 4,
                       "seed": 0, "prompt_format": "auto", "methods": methods, "options": {}},
            "methods": {name: {"source": ROWS.get(name, ("accelgen",))[0], "family": "baseline", "needs": [],
                               "lossless": "distribution-exact", "summary": ""} for name in methods},
            "metadata": {"command": "accelgen bench", "date": "today", "machine": MACHINE, "versions": VERSIONS,
                         "dtype": "bfloat16", "draft_dtype": "bfloat16", **metadata},
            "cost": {"target_forward_seconds": 0.1, "draft_forward_seconds": 0.01, "cost_ratio": 0.1}}


def mixed_records() -> list[dict]:
    records = []
    for name, (source, weights, draft_weights, reference, speed_reference) in ROWS.items():
        tokens = TOKENS.get(name, TOKENS["hf-greedy"] if weights == "bf16" else TOKENS["autoregressive@weights=int8"])
        records.append({"prompt_id": "1", "category": "writing", "method": name, "seconds": SECONDS[name],
                        "token_ids": tokens, "new_tokens": len(tokens), "target_forwards": None,
                        "committed_per_step": None, "draft_tokens": None, "accepted_draft_tokens": None,
                        "draft_seconds": None, "weights": weights, "draft_weights": draft_weights,
                        "reference": reference, "speed_reference": speed_reference,
                        **({"quality_only": True} if name in ("autoregressive@weights=int8", "llamacpp") else {})})
    return records


def write_run(folder, info: dict, records: list[dict]):
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps(info))
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_rows_in_several_formats_show_tokens_per_second_and_both_speedups(tmp_path):
    info = run_info(list(ROWS), {"weights": "bf16", "draft_weights": "bf16",
                                 "gguf_files": {"target": "m.Q4_K_M.gguf"}})
    results = report.render(write_run(tmp_path / "run", info, mixed_records()))
    overall = results["aggregates"]["overall"]
    speculative = overall["speculative@weights=int8+draft_weights=int4"]
    assert speculative["speedup_total"] == 4.0  # hf-greedy's 8 s over its 2 s
    assert speculative["format_speedup_total"] == 2.0  # autoregressive@weights=int8's 4 s over its 2 s
    assert speculative["tokens_per_second"] == 2.0 and speculative["identical"] == 1
    assert overall["autoregressive"]["format_speedup_total"] == 1.0
    assert overall["autoregressive"]["speedup_total"] == pytest.approx(0.8)
    assert overall["llamacpp"]["format_speedup_total"] is None  # no autoregressive row on the GGUF file in this run
    assert overall["llamacpp-ngram"]["identical"] == 0 and overall["llamacpp-ngram"]["speedup_total"] == 10.0
    # quantized rows differing from bf16 are a quality cost, not an error; llama.cpp's own rows are checked
    # against the plain llamacpp row
    assert [w["method"] for w in results["warnings"]] == ["llamacpp-ngram"]
    assert results["warnings"][0]["reference"] == "llamacpp" and results["warnings"][0]["source"] == "llamacpp"
    text = (tmp_path / "run" / "report.md").read_text()
    assert "AMD EPYC; flags: avx2 fma f16c (no native bf16)" in text
    assert "- weights: target bf16, draft bf16" in text and "target m.Q4_K_M.gguf" in text
    header = next(line for line in text.splitlines() if line.startswith("| method |")).split(" | ")
    row = next(line for line in text.splitlines() if line.startswith("| speculative@")).split(" | ")
    cell = dict(zip(header, row))
    assert cell["weights"] == "int8 (draft int4)" and cell["tokens/s"] == "2.00"
    assert cell["speedup vs hf-greedy (total)"] == "4.00×" and cell["vs autoregressive, same weights"] == "2.00×"
    assert cell["compared with"] == "autoregressive@weights=int8"
    assert "**peer mismatch** (llamacpp) llamacpp-ngram: differs from llamacpp" in text
    assert (tmp_path / "run" / "tokens.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_from_before_formats_and_flags_still_renders(tmp_path):
    machine = {key: value for key, value in MACHINE.items() if key not in ("flags", "native_bf16")}
    info = run_info(["hf-greedy", "pld"], {"machine": machine})
    records = [{key: value for key, value in record.items()
                if key not in ("weights", "draft_weights", "reference", "speed_reference", "quality_only")}
               for record in mixed_records()[:2]]
    records[1]["method"] = "pld"
    results = report.render(write_run(tmp_path / "old", info, records))
    assert results["aggregates"]["overall"]["pld"]["identical"] == 1  # compared with hf-greedy, as then
    text = (tmp_path / "old" / "report.md").read_text()
    assert "flags: n/a" in text and "- weights: target bfloat16" in text
    row = next(line for line in text.splitlines() if line.startswith("| pld |")).split(" | ")
    assert row[1] == "n/a"  # weights not recorded


LONG_NAME = "speculative@weights=gguf+draft_weights=gguf+gamma_schedule=cost"


@pytest.mark.parametrize("width", [200, 100])
def test_the_console_table_never_cuts_a_method_name(tmp_path, monkeypatch, capsys, width):
    """Whole on a wide console; folded onto more lines, never ending in '…', on a narrow one."""
    from rich.console import Console

    import accelgen.cli.bench
    from accelgen.cli.bench import print_summary

    records = mixed_records()[:2]
    records[1]["method"] = LONG_NAME
    results = report.render(write_run(tmp_path / "run", run_info(["hf-greedy", LONG_NAME], {}), records))
    monkeypatch.setattr(accelgen.cli.bench, "table_console", lambda: Console(width=width))
    print_summary(results, tmp_path / "run")
    lines = capsys.readouterr().out.splitlines()
    method_cells = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
    assert "…" not in "".join(lines)
    assert "".join(method_cells[1:]) == LONG_NAME  # the rows after hf-greedy's hold the name, in order
    if width == 200:
        assert method_cells == ["hf-greedy", LONG_NAME]
