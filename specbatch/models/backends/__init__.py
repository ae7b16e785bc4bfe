"""Step backends: the code that runs one packed prefill or decode/verify step of a
``LlamaForward``, one per device and dtype (docs/design.md, "Which forward path runs").

``LlamaForward`` keeps the weights, RoPE, the norms and the layer loop (``run_layers``); a
backend supplies each layer's attention and the step around it. ``select_backend`` picks one,
once, when the forward is built:

| backend | module | runs when |
|---|---|---|
| ``TritonBackend`` | ``triton_cuda.py`` | the Triton kernels are enabled (CUDA with ``triton``; ``SPECBATCH_KERNELS=1``) for a float16/bfloat16/float32 model with head_dim a power of 2 >= 16 |
| ``CpuBackend`` | ``cpu.py`` | float32 or int8 on a CPU where the C attention builds: one C call per step, or its torch-loop mode |
| ``TorchBackend`` | ``reference.py`` | everything else (bfloat16, float64, CUDA without Triton, the C kernels off) |

The switches are read in ``specbatch/settings.py`` (through the kernels' ``available``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from specbatch.engine.kv_cache import KVCache

__all__ = ["StepBackend", "cpu_backend_name", "select_backend"]


class StepBackend(Protocol):
    """One packed step of a ``LlamaForward`` (``ModelRunner`` calls these and nothing else).

    name: the backend's name; on the CPU the calibration cache's key
        (``auto.costmodel.kernel_path``: ``ckernels``, ``ckernels_vnni`` / ``_avx2`` /
        ``_portable`` for int8, ``torch``), elsewhere ``triton`` or ``torch``.
    kv_dtype: the KV cache's dtype (the model's; float16 for int8 on the one-call C step).
    min_query_len: query slots a one-row decode step is padded to (1 where every op is
        row-invariant from one token, else 2).
    prefill_per_token: whether a prompt token's keys and values depend only on the tokens
        before it in its row (not on where its prefill chunk starts), so a row may start its
        prefill from another row's keys (``ModelRunner.start``'s prefix caching).
    packed_attention: whether a packed verify step's attention costs by its real tokens, not
        by its rows padded to the longest (``CostModel.packed``).
    """

    name: str
    kv_dtype: torch.dtype
    min_query_len: int
    prefill_per_token: bool
    packed_attention: bool

    def prefill(self, input_ids: torch.Tensor, cache: KVCache,
                chunks: list[tuple[int, int, int]], logits_at: list[int]) -> torch.Tensor:
        """Prompt chunks of several rows in one forward, packed without padding.

        input_ids: ``[T]`` int64, the chunks' tokens back to back; chunks: ``(row, start,
        length)`` per chunk; logits_at: indices into ``[T]`` whose logits are wanted.
        Returns logits ``[len(logits_at), vocab]``, float32 (float64 for a float64 model).
        See ``TorchBackend.prefill``."""
        ...

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
             rows: torch.Tensor, logits_index: torch.Tensor | None = None,
             num_fed: torch.Tensor | None = None) -> torch.Tensor:
        """One decode/verify step over ``[B, Q]`` new tokens (int64 ids and positions, cache
        rows ``[B]``); writes their keys and values into ``cache``. Returns logits ``[B, Q or
        M, vocab]``, float32 (float64 for a float64 model); a backend that packs a step given
        ``num_fed`` returns the real tokens' ``[sum(num_fed), vocab]`` in row order instead
        (``runner.verify`` takes either). See ``TorchBackend.step``."""
        ...


def cpu_backend_name(dtype: str) -> str:
    """The name of the backend a CPU model of ``dtype`` (``"float32"``, ``"int8"``,
    ``"bfloat16"``, ...) runs on, known without a model: ``"ckernels"`` where specbatch's C
    matmul runs the dense layers (float32 and int8, x86-64 with AVX2 + FMA and a C compiler,
    the switches of ``settings`` not turning it off), for int8 ``"ckernels_"`` plus the 8-bit
    matmul ``kernels.linear_cpu.int8_kernel()`` reports (``vnni``, ``avx2``, ``portable``),
    else ``"torch"``. Builds the C kernels on first use (~3 s, once per machine)."""
    if dtype not in ("float32", "int8"):  # bfloat16 and float64 run on torch's kernels
        return "torch"
    try:
        from specbatch.kernels import linear_cpu
    except ImportError:  # an install without the kernels package
        return "torch"
    if not linear_cpu.available():
        return "torch"
    return f"ckernels_{linear_cpu.int8_kernel()}" if dtype == "int8" else "ckernels"


def select_backend(forward) -> StepBackend:
    """The backend of ``forward`` (a ``LlamaForward`` whose weights, dense matmul
    ``forward.linear`` and int8 marking are set): chosen once, from the model's dtype, device
    and sizes and the ``SPECBATCH_*`` switches (``settings``).

    - ``TritonBackend`` where the Triton kernels are enabled for the model
      (``triton_cuda.can_use_kernels``); its prefill and ``logits_index`` steps run on the
      backend below.
    - ``CpuBackend`` where the C attention runs (a float32 CPU model, ``cpu.attention_for``),
      in its one-C-call mode where ``cpu.decode_for`` builds the layers.
    - ``TorchBackend`` otherwise.
    """
    from specbatch.models.backends import cpu, triton_cuda
    from specbatch.models.backends.reference import TorchBackend

    if forward.device.type == "cpu":
        name = cpu_backend_name("int8" if forward.activations == "int8"
                                else str(forward.dtype).removeprefix("torch."))
    else:
        name = "torch"
    attention = cpu.attention_for(forward)
    if attention is None:
        backend: StepBackend = TorchBackend(forward, name)
    else:
        backend = cpu.CpuBackend(forward, name, attention, cpu.decode_for(forward, attention))
    if triton_cuda.can_use_kernels(forward):
        return triton_cuda.TritonBackend(forward, backend)
    return backend
