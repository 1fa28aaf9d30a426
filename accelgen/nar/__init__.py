"""Non-autoregressive (NAR) generation (the survey's section 4): models that emit many or all tokens of an output
at once, lossy by design, measured against an autoregressive (AR) student of the same size trained on the same
data.

The task is code summarisation: a Python function without its docstring in, the docstring's first line out.

- data.py: mining (function, summary) pairs from installed Python files, split by package, cached as JSONL;
- tokens.py: a compact vocabulary over a Hugging Face tokenizer, and the padded tensors of a corpus;
- backbone.py: the encoder-decoder every method shares (causal or parallel decoder, length predictor),
  saved as safetensors + a JSON config naming the method;
- ar.py (the AR student), nat.py (Gu et al. 2018: fertility, noisy parallel decoding), mask_predict.py
  (Ghazvininejad et al. 2019), sat.py (Wang et al. 2018, K tokens per step): one method each;
- train.py: the training helper they share (accelgen/train/loop.py's loop, held-out loss, checkpoints).

Nothing here is imported by `import accelgen`: the package is loaded only by what uses it.
"""
