"""On-device export of QKVShare language models: `torch.export`, ExecuTorch (.pte) and ONNX, with the static tied
cache (`QKVShareStaticCache`: ONE preallocated buffer per tied K=V layer) held inside the program.

Design notes
- `StaticCacheDecoder` is our counterpart of transformers' `TorchExportableModuleWithStaticCache`
  (transformers/integrations/executorch.py). That wrapper builds a transformers `StaticCache`, which holds K and V
  for every layer; ours holds a `QKVShareStaticCache`, allocated up front (`early_initialization`) and registered as
  buffers: the tied layers' single buffers, the untied layers' key and value buffers, the layers' lengths, and the
  positions buffer that pre-RoPE ties and "+" read. The exported program writes them in place, so the runtime
  (ExecuTorch) or the caller (ONNX: `OnnxDecoder` feeds them back) carries the cache from call to call.
- Its signature is ExecuTorch's LLM runner's: `forward(input_ids (B, T), cache_position (T,)) -> logits (B, T, V)`.
  `cache_position` says where the new tokens go (the layers' lengths are set from `cache_position[0]`, as
  transformers' wrapper does), so one program runs the prefill (T = prompt length) and every decode step (T = 1),
  and a new prompt simply starts again at position 0. T is a dynamic dimension, 1 to `max_cache_len`.
- `export_decoder` runs `torch.export` on it; `to_executorch` lowers that program (XNNPACK partitioner, whose
  kernels run on any x86-64/ARM CPU; `backend="portable"` keeps ExecuTorch's portable kernels); `to_onnx` converts
  it with `torch.onnx.export(dynamo=True)`.
- `greedy_generate` drives any of them (the eager wrapper, an ExportedProgram, an ExecuTorch method, an ONNX
  session) the same way, so tests and `qkvshare export` compare their tokens with `model.generate`.
- The command (`qkvshare export`) is `export_model(ExportArgs(...))` (settings of `qkvshare_settings.export`, parsed
  without torch). Before it loads the model it checks the model directory (`check_model_dir`: config.json, what the
  format cannot hold, e.g. a sliding window, a cache too short for the token check) and the output (`check_output`:
  never one of the model's own files, writable, an existing file only with `overwrite`). It writes every output
  beside its place and moves it there when complete (`write_beside`); a disk that fills up while writing is an
  `ExportWriteError` naming the path and the space, with nothing left half-written. `--format llama` and `gguf`
  (variants that are exactly Llama) are export_llama.py's.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, LlamaForCausalLM

from qkvshare_settings.conventions import CommandStopped
from qkvshare_settings.export import (
    CHECK_PROMPT_TOKENS,
    DEFAULT_MAX_CACHE_LEN,
    PROGRAM_FORMATS,
    ExportArgs,
    check_max_cache_len,
    check_output,
)

from .cache_qkvshare import QKVShareCache, QKVShareStaticCache
from .configuration_qkvshare import QKVShareConfig, kv_cache_bytes_per_token
from .export_llama import check_llama_export, save_llama, to_llama, write_gguf
from .model_dir import check_weights_fit_config, load_source_tokenizer, read_config_json
from .modeling_qkvshare import QKVShareForCausalLM
from .runtime import check_free_space, describe_disk_full, is_disk_full, torch_dtype

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids (B, T), cache_position (T,)) -> logits


class StaticCacheDecoder(nn.Module):
    """A QKVShare causal LM with its `QKVShareStaticCache` inside, as buffers: the module `torch.export` exports.

    Args:
        model: a `QKVShareForCausalLM` (eval mode; the "+" variants need the sdpa or eager attention backend).
        max_cache_len: token slots of the cache (prompt + generated tokens).
        batch_size: sequences decoded together.

    Buffers (not persistent: never saved with the weights): `cache_{i}_keys` (B, H_kv, max_cache_len, D) for every
    layer i, `cache_{i}_values` of the same shape for untied layers only, `cache_{i}_length` (0-d int64), and
    `cache_positions_full_attention` (B, 1, max_cache_len, 1) int64 with its length when the config needs the key
    positions (pre-RoPE ties, "+", ALiBi, QV-Ka with RoPE). QV-Ka layers hold their context G in `cache_{i}_keys`
    (B, 1, max_cache_len, d_ctx) and their values in `cache_{i}_values`.
    """

    def __init__(self, model: nn.Module, max_cache_len: int, batch_size: int = 1):
        super().__init__()
        config = model.config
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
        limit = config.max_position_embeddings
        if config.position_embedding_type == "learned" and isinstance(max_cache_len, int) and max_cache_len > limit:
            raise ValueError(
                f"max_cache_len={max_cache_len} is beyond max_position_embeddings={limit} of this model's learned "
                f"position table; use max_cache_len <= {limit}."
            )
        self.model = model
        self.cache = QKVShareStaticCache(config, max_cache_len=max_cache_len)  # checks max_cache_len, the kernel
        dtype, device = model.dtype, model.device
        self.cache.early_initialization(batch_size, config.num_key_value_heads, config.head_dim, dtype, device)
        for kind, layer in self.cache.position_layers.items():  # allocated by early_initialization when tracked
            self.register_buffer(f"cache_positions_{kind}", layer.keys, persistent=False)
            self.register_buffer(f"cache_positions_{kind}_length", layer.cumulative_length, persistent=False)
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"cache_{i}_keys", layer.keys, persistent=False)
            if layer.values is not None:  # untied layers only: a tied layer's one buffer is its key and value
                self.register_buffer(f"cache_{i}_values", layer.values, persistent=False)
            self.register_buffer(f"cache_{i}_length", layer.cumulative_length, persistent=False)

    @property
    def max_cache_len(self) -> int:
        return self.cache.max_cache_len

    @property
    def batch_size(self) -> int:
        return self.cache.layers[0].keys.shape[0]

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) of `input_ids` (B, T) written at cache slots `cache_position` (T,) (consecutive); the
        slots before `cache_position[0]` are the context. Start a new sequence with `cache_position[0] == 0`."""
        for layer in (*self.cache.layers, *self.cache.position_layers.values()):
            layer.cumulative_length.copy_(cache_position[0])
        return self.model(input_ids=input_ids, cache=self.cache, use_cache=True).logits

    def cache_bytes(self) -> int:
        """Bytes of the cache buffers the program holds (all slots, every sequence, positions included)."""
        return self.cache.nbytes()

    def cache_bytes_per_token(self) -> float:
        """Cache bytes per token slot of one sequence: `cache_bytes() / (batch_size * max_cache_len)`."""
        return self.cache_bytes() / (self.batch_size * self.max_cache_len)


def export_decoder(
    decoder: StaticCacheDecoder | FunctionalDecoderStep, dynamic: bool = True
) -> torch.export.ExportedProgram:
    """`torch.export` (strict, as transformers' ExecuTorch recipe) of a `StaticCacheDecoder` (cache in buffers) or a
    `FunctionalDecoderStep` (cache in and out): one program for the prefill and the decode steps (T dynamic,
    1..max_cache_len) or, with `dynamic=False`, for decode steps only (T = 1)."""
    length = 2 if dynamic else 1
    device = next(decoder.model.parameters()).device
    state = tuple(getattr(decoder, "initial_state", ()))
    input_ids = torch.zeros((decoder.batch_size, length), dtype=torch.long, device=device)
    cache_position = torch.arange(length, dtype=torch.long, device=device)
    shapes = None
    if dynamic:
        tokens = torch.export.Dim("tokens", min=1, max=decoder.max_cache_len)
        shapes = ({1: tokens}, {0: tokens}, *([(None,) * len(state)] if state else []))
    with torch.no_grad():
        return torch.export.export(decoder, (input_ids, cache_position, *state), dynamic_shapes=shapes, strict=True)


class FunctionalDecoderStep(nn.Module):
    """The decoder as a pure function, for runtimes without mutable state (ONNX):
    `forward(input_ids (B, T), cache_position (T,), *cache) -> (logits (B, T, V), *updated cache)`.

    `cache` are the cache tensors of `decoder` (`state_names`, in order: each layer's keys, the untied layers'
    values, the positions buffer when tracked), whose current values the caller feeds back; the layers' lengths
    come from `cache_position[0]` as in `StaticCacheDecoder.forward`. Inside, a `QKVShareStaticCache` is rebuilt
    around copies of them (the cache's pytree registration), written in place and returned.
    """

    def __init__(self, decoder: StaticCacheDecoder):
        super().__init__()
        self.model = decoder.model
        paths, self.cache_spec = torch.utils._pytree.tree_flatten_with_path(decoder.cache)
        # Each flat leaf of the cache is a layer length (set from cache_position), None (a tied layer's values, no
        # positions) or a cache tensor (an input and an output of the step).
        self.leaf_kinds = [
            "length" if getattr(path[-1], "key", None) == "cumulative_length" else "none" if leaf is None else "state"
            for path, leaf in paths
        ]
        states = [(path, leaf) for (path, leaf), kind in zip(paths, self.leaf_kinds) if kind == "state"]
        self.state_names = [
            "_".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", "")))) for k in path)
            for path, _ in states
        ]
        self.initial_state = [leaf for _, leaf in states]
        self.batch_size, self.max_cache_len = decoder.batch_size, decoder.max_cache_len

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, *state: torch.Tensor):
        leaves, given = [], iter(state)
        for kind in self.leaf_kinds:
            leaves.append(
                None if kind == "none" else cache_position[0].clone() if kind == "length" else next(given).clone()
            )
        cache = torch.utils._pytree.tree_unflatten(leaves, self.cache_spec)
        logits = self.model(input_ids=input_ids, cache=cache, use_cache=True).logits
        return (logits, *[leaf for leaf, kind in zip(leaves, self.leaf_kinds) if kind == "state"])


# ----------------------------------------------------------------------------- lowering
def to_executorch(program: torch.export.ExportedProgram, backend: str = "xnnpack") -> bytes:
    """Lower an exported `StaticCacheDecoder` to an ExecuTorch program (the bytes of a .pte file).

    `backend="xnnpack"` delegates what XNNPACK supports (linear, matmul, ...) to it; `"portable"` keeps ExecuTorch's
    portable kernels only. The cache buffers stay mutable buffers of the program (planned memory, not inputs).
    """
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    partitioners = []
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioners = [XnnpackPartitioner()]
    elif backend != "portable":
        raise ValueError(f"backend={backend!r}: allowed: xnnpack, portable.")
    edge = to_edge_transform_and_lower(
        program, partitioner=partitioners, compile_config=EdgeCompileConfig(_check_ir_validity=False)
    )
    # Memory for the dynamic length is planned at its upper bound (max_cache_len), as optimum-executorch does.
    config = ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
        sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
    )
    return edge.to_executorch(config).buffer


def executorch_step(pte: bytes | str | Path) -> Step:
    """Load an ExecuTorch program with executorch's runtime; its `forward` as a `Step`."""
    from executorch.runtime import Runtime

    # The Program owns the bytes the Method runs on: the step keeps it alive (a freed program crashes the Method).
    program = Runtime.get().load_program(pte if isinstance(pte, bytes) else Path(pte))
    method = program.load_method("forward")

    def step(input_ids: torch.Tensor, cache_position: torch.Tensor, _program=program) -> torch.Tensor:
        return method.execute([input_ids, cache_position])[0]

    return step


def to_onnx(step: FunctionalDecoderStep, path: str | Path, dynamic: bool = True) -> None:
    """Write `step` as an ONNX model (`torch.onnx.export(dynamo=True)` of its exported program): inputs
    `input_ids`, `cache_position` and the cache tensors (`step.state_names`); outputs `logits` and the updated cache
    tensors (`<name>_out`)."""
    program = export_decoder(step, dynamic=dynamic)
    outputs = ["logits", *[f"{name}_out" for name in step.state_names]]
    torch.onnx.export(
        program,
        (),
        str(path),
        dynamo=True,
        input_names=["input_ids", "cache_position", *step.state_names],
        output_names=outputs,
        external_data=False,
    )


class OnnxDecoder:
    """An ONNX model written by `to_onnx`, run with onnxruntime as a `Step`: it keeps the cache tensors between
    calls and feeds them back (numpy arrays, the shapes of `state_names`)."""

    def __init__(self, path: str | Path, state_names: list[str], initial_state: list[torch.Tensor]):
        import onnxruntime

        self.session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.state_names = list(state_names)
        self.state = [t.detach().cpu().numpy().copy() for t in initial_state]

    def __call__(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        feeds = {"input_ids": input_ids.cpu().numpy(), "cache_position": cache_position.cpu().numpy()}
        logits, *self.state = self.session.run(None, feeds | dict(zip(self.state_names, self.state)))
        return torch.from_numpy(logits)


def reference_tokens(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The eager model's greedy tokens (B, max_new_tokens) after `prompt`, decoded through its default dynamic
    `QKVShareCache` (not the static cache the programs hold) and, like `greedy_generate`, never stopping at an
    end-of-sequence token, so the two compare token for token."""
    cache = QKVShareCache(model.config)
    return greedy_generate(lambda ids, _: model(ids, cache=cache, use_cache=True).logits, prompt, max_new_tokens)


def greedy_generate(step: Step, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy tokens (B, max_new_tokens) after `prompt` (B, T): one prefill call, then one call per new token.

    `step` is a `StaticCacheDecoder`, an exported program's module, `executorch_step(...)` or an `OnnxDecoder`.
    """
    with torch.no_grad():
        logits = step(prompt, torch.arange(prompt.shape[1]))
        tokens = [logits[:, -1].argmax(-1)]
        for i in range(max_new_tokens - 1):
            position = torch.tensor([prompt.shape[1] + i])
            tokens.append(step(tokens[-1][:, None], position)[:, -1].argmax(-1))
    return torch.stack(tokens, 1)


# ----------------------------------------------------------------------------- qkvshare export
def check_model_dir(args: ExportArgs) -> str | None:
    """Check `args` against the model directory (config.json, the tokenizer; no weight is read) and fill the
    defaults that depend on it (`--max_cache_len`, `--output`); a `ValueError` naming the bad input. Returns
    llama.cpp's pre-tokenizer name of the model's tokenizer for `--format gguf`, else None."""
    model_type = read_config_json(args.model_dir).get("model_type")  # a ValueError when it is not a model
    if model_type != "qkvshare":
        raise ValueError(
            f"{args.model_dir} holds a {model_type!r} model, not a QKVShare one (model_type 'qkvshare'); pass a "
            "directory written by QKVShareForCausalLM.save_pretrained or `qkvshare train`."
        )
    config = QKVShareConfig.from_pretrained(args.model_dir)
    pre_tokenizer = None
    if args.format in PROGRAM_FORMATS:
        check_program_export(config, args)
    else:
        pre_tokenizer = check_llama_export(config, args.model_dir, args.format)
    args.output = str(check_output(Path(args.model_dir), args.format, args.output, args.overwrite))
    return pre_tokenizer


def check_program_export(config: QKVShareConfig, args: ExportArgs) -> None:
    """What an ExecuTorch or ONNX program cannot hold, and the cache length (filled in when left out)."""
    limit = config.max_position_embeddings
    if args.max_cache_len is None:
        args.max_cache_len = min(limit, DEFAULT_MAX_CACHE_LEN)
        check_max_cache_len(args.max_cache_len, args.check_tokens)
    if config.position_embedding_type == "learned" and args.max_cache_len > limit:
        raise ValueError(
            f"--max_cache_len {args.max_cache_len} is beyond max_position_embeddings={limit} of this model's learned "
            f"position table; use --max_cache_len {limit} or less."
        )
    if config.attention_kernel == "linear":
        raise ValueError(
            f"{args.model_dir} uses attention_kernel='linear' (a constant-size state, no static cache); qkvshare "
            "export supports softmax-attention models."
        )
    sliding = [i for i in range(config.num_hidden_layers) if config.layer_attention_type(i) == "sliding_attention"]
    if sliding:
        raise ValueError(
            f"{args.model_dir} has sliding-window attention (sliding_window={config.sliding_window}, layers "
            f"{', '.join(map(str, sliding))}): the static sliding-window cache cannot be traced into a program yet; "
            "qkvshare export supports models whose layers attend to every token."
        )


class ExportWriteError(CommandStopped):
    """The export could not be written (a full disk); nothing half-written is left at the output."""


class ExportCheckFailed(CommandStopped):
    """The written export's greedy tokens are not the model's (both are printed above the message)."""

    label = "error"


def write_beside(output: Path, write: Callable[[Path], None], needed_bytes: int | None = None) -> None:
    """`write(path)` to a temporary path beside `output`, then move it to `output`: an interrupted or failed export
    leaves nothing half-written there (and the previous file, if any, intact). `needed_bytes` (about what the export
    takes) is checked against the free space first; a disk that fills up anyway is an `ExportWriteError`."""
    if needed_bytes is not None:
        check_free_space(output.parent, needed_bytes, f"the export {output}")
    temporary = output.with_name(f".{output.name}.partial-{os.getpid()}")
    try:
        write(temporary)
        os.replace(temporary, output)
    except BaseException as err:
        if temporary.is_dir():
            shutil.rmtree(temporary)
        temporary.unlink(missing_ok=True)
        if is_disk_full(err):
            kept = "the previous file is unchanged" if output.exists() else "nothing was written"
            raise ExportWriteError(f"{describe_disk_full(output, needed_bytes)}; {kept}.") from err
        raise


def export_model(args: ExportArgs) -> Path:
    """`qkvshare export MODEL_DIR --format executorch|onnx|llama|gguf`: write the export, print what it holds, and
    compare its greedy tokens with the model's (`args.check_tokens`); returns the path written.

    Raises a `ValueError` for bad input before the model is loaded, `ExportWriteError` for a write that failed (a full
    disk) and `ExportCheckFailed` when the written model's greedy tokens differ from the model's."""
    pre_tokenizer = check_model_dir(args)
    check_weights_fit_config(args.model_dir, model_class=QKVShareForCausalLM)
    if args.format in PROGRAM_FORMATS:
        export_program(args)
    else:
        export_llama(args, pre_tokenizer)
    return Path(args.output)


def export_program(args: ExportArgs) -> None:
    """`export_model` of an ExecuTorch or ONNX program (after the checks)."""
    model = QKVShareForCausalLM.from_pretrained(args.model_dir, attn_implementation="sdpa").eval()
    config = model.config
    decoder = StaticCacheDecoder(model, max_cache_len=args.max_cache_len, batch_size=args.batch_size)
    output = Path(args.output)
    start = time.perf_counter()
    if args.format == "executorch":
        program = to_executorch(export_decoder(decoder), backend=args.backend)
        write_beside(output, lambda path: path.write_bytes(program), len(program))
        step = executorch_step(output)
    else:
        functional = FunctionalDecoderStep(decoder)
        write_beside(output, lambda path: to_onnx(functional, path))
        step = OnnxDecoder(output, functional.state_names, functional.initial_state)
    seconds = time.perf_counter() - start
    element = torch.finfo(model.dtype).bits // 8
    theory = kv_cache_bytes_per_token(config, element, positions=True)
    backend = f", {args.backend}" if args.format == "executorch" else ""
    print(f"wrote {output} ({args.format}{backend}): {output.stat().st_size:,} bytes in {seconds:.1f} s")
    print(
        f"cache: {decoder.cache_bytes_per_token():,.0f} bytes per token (theory {theory:,}: "
        f"{config.variant}, {model.dtype}), {decoder.cache_bytes():,} bytes of cache buffers in all "
        f"({args.batch_size} x {args.max_cache_len} token slots)"
    )
    if not args.check_tokens:
        return
    new_tokens = min(args.check_tokens, args.max_cache_len - CHECK_PROMPT_TOKENS)
    prompt = check_prompt(config, args.batch_size)
    compare_tokens("the written program", greedy_generate(step, prompt, new_tokens), model, prompt)


def export_llama(args: ExportArgs, pre_tokenizer: str | None) -> None:
    """`export_model` of a Llama checkpoint or a GGUF file (after the checks; see export_llama.py)."""
    model_dir, output = Path(args.model_dir), Path(args.output)
    model = QKVShareForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    dtype = model.dtype if args.dtype == "auto" else torch_dtype(args.dtype)
    llama, tokenizer = to_llama(model, dtype), load_source_tokenizer(str(model_dir))
    needed = sum(t.numel() * t.element_size() for t in llama.state_dict().values())  # tied copies: an upper bound
    if args.format == "llama":
        write_beside(output, lambda path: save_llama(llama, model_dir, path, tokenizer), needed)
        what = f"a LlamaForCausalLM checkpoint{' with its tokenizer' if tokenizer is not None else ''}"
    else:
        write_beside(output, lambda path: write_gguf(llama, tokenizer, model_dir, pre_tokenizer, path), needed)
        what = f"GGUF, architecture llama, tokenizer pre-type {pre_tokenizer!r}"
    size = sum(f.stat().st_size for f in output.rglob("*") if f.is_file()) if output.is_dir() else output.stat().st_size
    config, element = model.config, torch.finfo(dtype).bits // 8
    key_value_bytes = kv_cache_bytes_per_token(config, element, tied=False)
    print(f"wrote {output} ({what}, {str(dtype).removeprefix('torch.')}): {size:,} bytes")
    ours = config.kv_cache_bytes_per_token(element)
    against = f"against {ours:,} in this {config.variant} model's cache (one tensor per tied layer)"
    print(
        f"cache in the engines that run it: {key_value_bytes:,} bytes per token (K and V of every layer), "
        + (against if ours < key_value_bytes else "as in this model's own cache (no tied layer)")
    )
    if not args.check_tokens:
        return
    # The written weights are the model's rounded to `dtype`: compare in float32, the model rounded the same way.
    model.to(dtype).float()
    if args.format == "llama":
        written, reader = LlamaForCausalLM.from_pretrained(output, dtype=torch.float32), "LlamaForCausalLM"
    else:
        written = AutoModelForCausalLM.from_pretrained(output.parent, gguf_file=output.name, dtype=torch.float32)
        reader = "transformers' GGUF reader"
    written.eval()
    prompt = check_prompt(config, 1)
    cache = DynamicCache(config=written.config)
    with torch.no_grad():
        tokens = greedy_generate(
            lambda ids, _: written(ids, cache=cache, use_cache=True).logits, prompt, args.check_tokens
        )
        gap = (written(prompt).logits - model(prompt).logits).abs().max().item()
    compare_tokens(f"the written model (read by {reader}; prompt logits within {gap:.1e})", tokens, model, prompt)


def check_prompt(config: QKVShareConfig, batch_size: int) -> torch.Tensor:
    """The token check's prompt: `CHECK_PROMPT_TOKENS` random tokens per sequence, the same on every run."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, config.vocab_size, (batch_size, CHECK_PROMPT_TOKENS), generator=generator)


def compare_tokens(what: str, got: torch.Tensor, model: nn.Module, prompt: torch.Tensor) -> None:
    """Print whether `got` (B, N), greedy tokens of an export after `prompt`, are the model's; `ExportCheckFailed`
    when they are not."""
    expected = reference_tokens(model, prompt, got.shape[1])
    same = torch.equal(got, expected)
    print(
        f"greedy tokens of {what} vs the model ({got.shape[1]} after a {prompt.shape[1]}-token prompt): "
        + ("identical" if same else f"DIFFERENT\n  export: {got.tolist()}\n  model:  {expected.tolist()}")
    )
    if not same:
        raise ExportCheckFailed(f"the greedy tokens of {what} differ from the model's (both printed above).")
