"""Verification: which draft tokens the target accepts.

The target's token at every fed position is chosen first, by ``sampler.sample`` (argmax at
T = 0, position-keyed Gumbel-max above), exactly as plain decoding would choose it. Then:

- draft token j is **accepted** iff it equals the target's token at j and drafts 0..j-1 were;
- at the first mismatch the target's token there is emitted: the **recovered** token;
- if all drafts match, the target's token after the last draft is emitted: the **bonus** token.

So a step emits ``num_accepted + 1`` tokens, all equal to what k = 0 decoding would produce
(Leviathan et al. 2023, arXiv 2211.17192, with one-hot drafts; see ``sampler``). The count
itself is ``sampler.count_accepted``, beside the choice, so that the fused kernel's torch
reference (``kernels.sample_accept``) uses it without importing this module.
"""

from __future__ import annotations

import torch

from specbatch.spec_decode import sampler


def sample_and_accept(logits: torch.Tensor, meta, process=None, want_scaled: bool = False,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sampling and acceptance of one step, on the logits' device, without a host sync.

    logits: ``[T, V]`` float, the fed positions' logits in row order (``runner.verify``);
    meta: the step's ``engine.step_metadata.StepMetadata`` (on the same device); process:
    optional ``[T, V] -> [T, V]`` logits processing applied before sampling (``engine.logits``:
    grammar masks, logit_bias, penalties). On CUDA with Triton, and with neither ``process``
    nor min_p, this is one fused kernel (``kernels.sample_accept``, same ids); else
    ``sampler.sample`` and ``sampler.count_accepted`` in torch.
    Returns (target ids ``[B, Q]`` int64: the target's token at each fed position, padded
    slots hold -1; accepted draft tokens ``[B]`` int64; with ``want_scaled``, the scaled
    logits ``[T, V]`` float64 (logits / T, or logits at T = 0, bans applied: the logprob
    source), else None).
    """
    vocab = logits.shape[-1]
    sm = meta.sampling
    banned = sm.banned_mask(meta.num_tokens, vocab)
    if process is None and not sm.any_min_p and _use_kernel(logits):
        from specbatch.kernels.sample_accept import sample_accept

        target, accepted = sample_accept(
            logits, meta.cu_num_fed, meta.draft_ids, meta.num_draft, sm.temperature, sm.top_k,
            sm.top_p, sm.seeds, sm.output_positions, banned, any_top_k_p=sm.any_top_k_p,
            query_len=meta.query_len)
        scaled = None
        if want_scaled:
            flat = logits.double()
            if banned is not None:
                flat = flat.masked_fill(banned, float("-inf"))
            greedy = sm.temperature == 0
            scaled = flat / torch.where(greedy, torch.ones_like(sm.temperature),
                                        sm.temperature)[:, None]
        return target, accepted, scaled
    flat = logits if process is None else process(logits)
    ids, scaled = sampler.sample(flat, sm.temperature, sm.top_k, sm.top_p, sm.seeds,
                                 sm.output_positions, banned,
                                 sm.min_p if sm.any_min_p else None, want_scaled)
    target = meta.grid(ids, -1)  # -1 in the padded slots
    return (target, sampler.count_accepted(target, meta.draft_ids, meta.num_draft),
            scaled if want_scaled else None)


def greedy_accept(logits: torch.Tensor, meta, bitmask: torch.Tensor | None = None,
                  ) -> tuple[list[int], list[bool], list[list[int]]] | None:
    """An all-greedy step on the CPU in one pass per fed position (``kernels.select_cpu``, C):
    the argmax among the tokens ``bitmask`` allows (``engine.logits.step_bitmask``; None: all),
    as ``sample_and_accept`` with the masks as its ``process`` would choose, then acceptance
    and each row's NaN flag on the host (a step's few fed positions: torch's ops on them cost
    more than the loop).

    logits: ``[T, V]`` float32 on the CPU, the fed positions in row order; meta: the step's
    ``StepMetadata``.
    Returns host lists, as ``engine.step_metadata.fetch_step_results`` gives them: accepted
    draft tokens per row (``B`` ints), whether a row's fed logits held a NaN (``B`` bools) and
    the target's token at each fed position (``B`` lists of ``Q`` ints, padded slots -1); or
    None where it does not apply: another device or dtype, a row sampling at T > 0, a banned
    token (``min_tokens``), or no C kernels.
    """
    sm = meta.sampling
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or not sm.all_greedy
            or sm.num_banned):  # (min_p leaves a greedy row's argmax as it is: sampler.sample)
        return None
    try:
        from specbatch.kernels import select_cpu
    except ImportError:  # an install without the kernels package
        return None
    if not select_cpu.available():
        return None
    qlen = meta.query_len
    ids, nan = select_cpu.greedy_select(logits, None, bitmask)
    ids, nan, drafts = ids.tolist(), nan.tolist(), meta.draft_ids.tolist()
    accepted, has_nan, target = [], [], []
    start = 0
    for fed, draft in zip(meta.num_fed, drafts):
        row = ids[start:start + fed]
        n = 0  # draft j is accepted iff it equals the target's token there and 0..j-1 were
        while n < fed - 1 and draft[n] == row[n]:
            n += 1
        accepted.append(n)
        has_nan.append(any(nan[start:start + fed]))
        target.append(row + [-1] * (qlen - fed))
        start += fed
    return accepted, has_nan, target


def _use_kernel(logits: torch.Tensor) -> bool:
    if logits.dtype not in (torch.float32, torch.float64):
        return False
    try:
        from specbatch import kernels
    except ImportError:
        return False
    return kernels.enabled(logits.device)
