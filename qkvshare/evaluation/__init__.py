"""Evaluation of QKVShare (and any Hugging Face causal LM) checkpoints.

- `harness`: `qkvshare eval` (`evaluate(EvalArgs(...))`), lm-evaluation-harness's official 5-shot suite (HellaSwag,
  PIQA, ARC-Easy, ARC-Challenge, WinoGrande) on several models, lm-eval's JSON per model and the paper's
  side-by-side table.
- `perplexity`: `qkvshare perplexity` (`measure_perplexity(PerplexityArgs(...))`), token-weighted perplexity on
  packed held-out text, sliding window.
- `fidelity`: what a (converted) causal LM keeps of its source: perplexity, KL, greedy agreement, asked questions.
- `tasks`: the five tasks' splits and row schemas, the local-data checks and the offline group YAML.
- `table`: the markdown table. `common`: model checks and loading.
- `fixtures/`: a small set of each task in the official schemas, written for this project (tests, offline demo).

Submodules are imported on use, so `import qkvshare.evaluation` does not import lm-eval; the settings are
`qkvshare_settings.eval.EvalArgs` and `qkvshare_settings.perplexity.PerplexityArgs`.
"""
