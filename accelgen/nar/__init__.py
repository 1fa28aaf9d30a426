"""Non-autoregressive (NAR) generation (the survey's section 4): models that emit many or all tokens of an output
at once, lossy by design, measured against an autoregressive (AR) student of the same size trained on the same
data.

The task is code summarisation: a Python function without its docstring in, the docstring's first line out.

- data.py: mining (function, summary) pairs from installed Python files, split by package, cached as JSONL;
- task.py: the task as a folder (splits, vocabulary, tokenizer) and the AR teacher's summaries (distillation);
- tokens.py: a compact vocabulary over a Hugging Face tokenizer, and the padded tensors of a corpus;
- backbone.py: the encoder-decoder every method shares (causal or parallel decoder, length predictor),
  saved as safetensors + a JSON config naming the method;
- one file per method: ar.py (the AR student), nat.py (Gu et al. 2018: fertility, noisy parallel decoding),
  enat.py (Guo et al. 2019), refine.py (Lee et al. 2018), mask_predict.py (Ghazvininejad et al. 2019), crf.py
  (Sun et al. 2019), sat.py (Wang et al. 2018), synst.py (Akoury et al. 2019), latent.py (Kaiser et al. 2018),
  flowseq.py (Ma et al. 2019), bert_nar.py (Su et al. 2021), curriculum.py (Guo et al. 2020, with DePA);
- methods.py: the methods by name, and model folders saved and loaded whatever their method;
- train.py: the training helper they share (accelgen/train/loop.py's loop, held-out loss, checkpoints);
- bench.py: quality (sacrebleu) and speed (passes, latency, throughput) side by side.

Nothing here is imported by `import accelgen`: the package is loaded only by what uses it.
"""
