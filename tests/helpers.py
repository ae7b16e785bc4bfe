"""Shared test helpers: tiny random Llama / Qwen2 models, an engine driver, repeating prompts.

Models are float64 with every parameter drawn fresh (biases and norm weights too, never the
zeros/ones transformers initialises them to) so a forward that skips a bias or a norm weight
gives different logits.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specbatch.config import SamplingParams
from specbatch.engine.engine import Completion, Engine
from specbatch.engine.runner import ModelRunner
from specbatch.engine.sequence import Request, StopRules
from specbatch.models.llama import LlamaForward
from specbatch.spec_decode.ngram import NgramProposer
from specbatch.spec_decode.proposer import NoProposer

# The tiny models run thousands of small ops; on a shared 2-core machine intra-op threads only
# add contention (10-100x slower), so tests that import these helpers run single-threaded.
torch.set_num_threads(1)

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw every parameter: weights ~ N(0, 1/fan_in), embeddings ~ N(0, 0.25^2),
    biases ~ N(0, 0.1^2), norm weights ~ 1 + N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.25 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))
    return model


def tiny_llama(vocab_size: int = 96, seed: int = 0,
               rope_parameters: dict | None = None) -> LlamaForCausalLM:
    """2 layers, hidden 64, 4 query heads over 2 kv heads (GQA), untied lm_head, float64."""
    extra = {"rope_parameters": rope_parameters} if rope_parameters else {}
    cfg = LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=False, **_COMMON, **extra)
    with torch.random.fork_rng():
        model = LlamaForCausalLM(cfg).double().eval()
    return _randomize(model, seed)


def tiny_qwen2(vocab_size: int = 96, seed: int = 0) -> Qwen2ForCausalLM:
    """Qwen2: q/k/v biases and tied embeddings (lm_head is embed_tokens), float64."""
    cfg = Qwen2Config(vocab_size=vocab_size, tie_word_embeddings=True, **_COMMON)
    with torch.random.fork_rng():
        model = Qwen2ForCausalLM(cfg).double().eval()
    model = _randomize(model, seed)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def gguf_exact(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every 2-D weight quantised with gguf (Q4_1 for the layers, Q8_0 for the
    embedding / lm_head, as the bundled GGUF) and dequantised back to float32."""
    import gguf

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                qtype = (gguf.GGMLQuantizationType.Q8_0 if "embed" in name or "lm_head" in name
                         else gguf.GGMLQuantizationType.Q4_1)
                back = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qtype), qtype)
                p.copy_(torch.from_numpy(back.copy()).view(p.shape))
    return model


@dataclass(frozen=True)
class BackendCase:
    """A step backend (``specbatch/models/backends``) the engine tests run a tiny model on.

    convert: the float64 tiny model -> the model that backend runs (dtype, device, int8 mark);
    env: the switches it needs while it runs (``switches``); check: asserts that a built
    ``LlamaForward``'s backend is the one meant; slow: Triton under its interpreter (run a
    couple of cases only)."""

    id: str
    convert: Callable[[torch.nn.Module], torch.nn.Module]
    check: Callable[[object], bool]
    env: tuple[tuple[str, str], ...] = ()
    slow: bool = False

    @contextmanager
    def switches(self):
        before = {name: os.environ.get(name) for name, _ in self.env}
        os.environ.update(dict(self.env))
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def forward(self, model: torch.nn.Module) -> LlamaForward:
        """``LlamaForward(model)`` built under the switches, its backend checked."""
        with self.switches():
            forward = LlamaForward(model)
        assert self.check(forward.backend), (self.id, type(forward.backend).__name__)
        return forward


def _int8(model: torch.nn.Module) -> torch.nn.Module:
    model = gguf_exact(model.float())
    model.specbatch_activations = "int8"  # as models/loader.py marks --dtype int8
    return model


def backend_cases() -> list[BackendCase]:
    """The step backends this machine runs: the torch reference in float64 always; the C
    kernels in float32 and int8 where they build for the tiny models' sizes; Triton where
    ``triton`` imports (on CUDA, else on CPU tensors under ``TRITON_INTERPRET=1``, which
    tests/conftest.py sets before any kernel module is imported)."""
    from specbatch import kernels

    cases = [BackendCase("torch-float64", lambda m: m,
                         lambda b: b.name == "torch" and b.kv_dtype == torch.float64)]
    try:
        from specbatch.kernels import decode_cpu
        c_kernels = decode_cpu.available(_COMMON["hidden_size"], 16)
    except ImportError:
        c_kernels = False
    if c_kernels:
        cases.append(BackendCase("c-float32", lambda m: m.float(),
                                 lambda b: b.name == "ckernels" and b.decode is not None))
        cases.append(BackendCase("c-int8", _int8,
                                 lambda b: b.name.startswith("ckernels_")
                                 and b.kv_dtype == torch.float16))
    if kernels.have_triton():
        if torch.cuda.is_available():
            cases.append(BackendCase("triton", lambda m: m.float().cuda(),
                                     lambda b: b.name == "triton"))
        elif os.environ.get("TRITON_INTERPRET") == "1":
            cases.append(BackendCase("triton-interpreter", lambda m: m.float(),
                                     lambda b: b.name == "triton",
                                     (("SPECBATCH_KERNELS", "1"),), slow=True))
    return cases


def cyclic_llama(vocab_size: int = 16, peak: float = 0.5, seed: int = 0) -> LlamaForCausalLM:
    """A tiny Llama whose next token is mostly ``succ(current)`` for a fixed random cycle
    ``succ`` over the vocabulary, with softmax mass spread over the rest (``peak`` sets how
    much): text that follows the cycle is what the n-gram proposer drafts, so drafts get
    accepted at T > 0 too, and rejected often enough for recovered tokens to matter.

    Built by shrinking the attention / MLP outputs (the residual stream stays near the current
    token's embedding) and pointing lm_head row ``succ(u)`` at token u's normed embedding.
    Returns the model; ``model.succ`` is the cycle as a list (``succ[u]``).
    """
    model = tiny_llama(vocab_size, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    order = torch.randperm(vocab_size, generator=gen).tolist()
    succ = [0] * vocab_size
    for a, b in zip(order, order[1:] + order[:1]):
        succ[a] = b
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
        emb = model.model.embed_tokens.weight
        normed = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True)) * model.model.norm.weight
        head = torch.empty_like(model.lm_head.weight)
        for u in range(vocab_size):
            head[succ[u]] = normed[u] * (peak / math.sqrt(normed.shape[1]))
        model.lm_head.weight.copy_(head)
    model.succ = succ
    return model


def cycle_prompt(succ: list[int], start: int, length: int) -> list[int]:
    out = [start]
    while len(out) < length:
        out.append(succ[out[-1]])
    return out


def repeating_prompts(vocab_size: int, num: int, seed: int = 0, min_len: int = 6,
                      max_len: int = 30) -> list[list[int]]:
    """Prompts made of a short random phrase repeated, so n-gram drafts have something to
    match; lengths vary so rows in a batch sit at different positions."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(num):
        phrase_len = int(torch.randint(3, 9, (1,), generator=gen))
        phrase = torch.randint(0, vocab_size, (phrase_len,), generator=gen).tolist()
        length = min_len + (i * 7) % (max_len - min_len + 1)
        prompts.append((phrase * (length // phrase_len + 1))[:length])
    return prompts


def make_engine(model, k: int, batch_size: int, *, eos_ids=(), max_model_len: int = 256,
                detokenize=None, prompt_lookup: tuple[int, int] = (1, 3),
                prefill_chunk: int = 1024, max_prefill_tokens: int = 2048,
                prefix_caching: bool = True) -> Engine:
    """An engine over ``model`` (a transformers model or a ``LlamaForward``-like object) with
    the n-gram proposer when k > 0, plain decoding when k = 0."""
    forward = LlamaForward(model) if isinstance(model, torch.nn.Module) else model
    runner = ModelRunner(forward, batch_size, max_model_len, initial_capacity=16,
                         prefill_chunk=prefill_chunk, max_prefill_tokens=max_prefill_tokens,
                         prefix_caching=prefix_caching)
    proposer = NgramProposer(*prompt_lookup) if k else NoProposer()
    stop_rules = StopRules(frozenset(eos_ids), max_model_len, detokenize)
    return Engine(runner, proposer, stop_rules, k, detokenize)


def run_engine(model, prompts: list[list[int]], k: int, batch_size: int,
               sampling: SamplingParams | list[SamplingParams], seeds: list[int] | None = None,
               **engine_kwargs) -> list[Completion]:
    """Generate one completion per prompt; returns them in prompt order.

    sampling: one ``SamplingParams`` for all prompts or one per prompt; seeds: one per prompt
    (default 0, 1, 2, ...). ``engine_kwargs`` go to ``make_engine``.
    """
    engine = make_engine(model, k, batch_size, **engine_kwargs)
    if isinstance(sampling, SamplingParams):
        sampling = [sampling] * len(prompts)
    seeds = list(range(len(prompts))) if seeds is None else seeds
    requests = [Request(i, list(p), sp, seed=s)
                for i, (p, sp, s) in enumerate(zip(prompts, sampling, seeds))]
    out: list[Completion | None] = [None] * len(requests)
    for c in engine.generate(requests):
        out[c.request.request_id] = c
    assert all(c is not None for c in out)
    return out


def total(completions: list[Completion], counter: str) -> int:
    return sum(getattr(c.stats, counter) for c in completions)


def at_thread_counts(fn, counts=(1, 2, 3)) -> list:
    """``fn()`` under each torch intra-op thread count (the C kernels share torch's OpenMP
    pool), the count restored afterwards: one result per count."""
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in counts:
            torch.set_num_threads(threads)
            outs.append(fn())
    finally:
        torch.set_num_threads(before)
    return outs
