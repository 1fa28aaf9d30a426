"""Benchmark harness: methods × datasets against HF greedy decoding, with equality checks, audits and plots.

    from accelgen.bench import report, runner
    bench_plan = runner.plan(runner.BenchConfig(model="smollm2-135m", dataset="humaneval", limit=20))
    runner.run(bench_plan, model, tokenizer, out_dir, draft_model)
    report.render(out_dir)

Modules: datasets (prompt loaders), methods (HF peers + registered methods, one timed run), runner (the
interleaved, resumable loop), metrics, audit (divergence classification), report and plots, cli.
"""
