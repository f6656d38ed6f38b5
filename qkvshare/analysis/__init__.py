"""Analysis tools: what sharing projections buys and costs.

- `costs`: analytic parameters, MACs and KV-cache bytes of every variant of a config (`qkvshare costs`).
- `bench`: measured cache bytes, decode speed, capacity and training throughput against `LlamaForCausalLM`
  (`qkvshare bench`).
- `compare`: pretrains several variants identically and tabulates the paper's LM table (`qkvshare compare`).
- `weights`: per-layer cosine similarity and effective rank of the Q, K, V projection weights of a checkpoint
  (`qkvshare analyze`).

Each command module exposes `main(argv) -> int` and `execute(args) -> int`, the command with the arguments its
parser in `qkvshare_cli` returns; `common` (variant configs, tables) and `plotting` hold the shared helpers,
`conventions` the `torch.dtype` of a `--dtype` name (the command-line conventions themselves are
`qkvshare_settings.conventions`).
"""
