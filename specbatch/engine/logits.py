"""Logits processing before sampling: grammar masks, ``logit_bias`` and the count penalties,
applied at every fed position of a verify step exactly as plain decoding would apply them there.

A verify step feeds row i its last committed token and drafts ``d_0 .. d_{m-1}``; the logits at
fed position j predict output position ``num_output_tokens + j``. Plain decoding would reach
that position only after committing ``d_0 .. d_{j-1}``, so position j is processed as if they
were committed:

- penalties count the output so far plus ``d_0 .. d_{j-1}``;
- the grammar mask is the matcher's after accepting ``d_0 .. d_{j-1}``.

Where a draft does not fit the grammar, the target's masked token there cannot equal it, so the
draft is rejected and no later position of the row is used: those positions are left unmasked.
The matcher is rolled back to the committed length before this returns, and advanced through
the committed tokens by ``commit`` (xgrammar ``GrammarMatcher.rollback``, as vLLM's structured
output does for speculative decoding).

Order, as vLLM v1's sampler: grammar mask, ``logit_bias``, then penalties (on the raw
logits); temperature, ``min_p``, top-k / top-p follow in ``spec_decode.sampler.sample``. The
masks of all rows are applied in one call after the bias and penalties, which gives the same
values: a masked logit is ``-inf`` either way (bias in [-100, 100], penalties finite, the
repetition penalty > 0 keep ``-inf``), an unmasked one is untouched by the mask (one xgrammar
call per step instead of one per row: ~0.15 ms each on the 2-core VM at 49,152 tokens).
Penalty formulas are vLLM's ``apply_penalties`` (repetition: Keskar et al. 2019, arXiv
1909.05858; presence / frequency: OpenAI's definition).
"""

from __future__ import annotations

import torch

from specbatch.engine.sequence import Sequence


def needs_bias_or_penalties(seqs: list[Sequence]) -> bool:
    """Whether any row has a ``logit_bias`` or a penalty (processing beyond grammar masks)."""
    return any(s.sampling.logit_bias or s.sampling.has_penalties for s in seqs)


def step_bitmask(seqs: list[Sequence], drafts: list[list[int]],
                 vocab: int) -> torch.Tensor | None:
    """``[T, ceil(V / 32)]`` int32, the packed grammar masks (``grammar_masks``) at every fed
    position of the step, row-major as ``process_logits``'s rows, all bits set for rows without
    a grammar; None when no row has one."""
    if all(s.matcher is None for s in seqs):
        return None
    from specbatch.engine import grammar

    bitmask = grammar._xgr().allocate_token_bitmask(sum(len(d) + 1 for d in drafts), vocab)
    start = 0
    for seq, d in zip(seqs, drafts):
        if seq.matcher is not None:
            bitmask[start:start + len(d) + 1] = grammar_masks(seq, d, vocab)
        start += len(d) + 1
    return bitmask


def process_logits(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                   bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """The logits plain decoding would sample from, at every fed position.

    logits: ``[T, V]`` float, the target's logits at the fed positions of every row, row-major
        (row i has ``len(drafts[i]) + 1`` of them, T = sum of those).
    seqs: the rows' sequences; drafts: each row's draft ids (as verified); bitmask: the step's
        ``step_bitmask``, when the caller has it already.
    Returns a new ``[T, V]`` tensor of the same dtype; ``logits`` is not modified.
    """
    out = logits.clone()
    vocab = logits.shape[-1]
    start = 0
    for seq, d in zip(seqs, drafts):
        n = len(d) + 1
        rows = out[start:start + n]  # a view: edits land in ``out``
        start += n
        sp = seq.sampling
        if sp.logit_bias:
            ids = torch.tensor([t for t, _ in sp.logit_bias if t < vocab], dtype=torch.int64)
            bias = torch.tensor([b for t, b in sp.logit_bias if t < vocab], dtype=rows.dtype)
            rows[:, ids.to(rows.device)] += bias.to(rows.device)
        if sp.has_penalties:
            _apply_penalties(rows, seq, d)
    if bitmask is None:
        bitmask = step_bitmask(seqs, drafts, vocab)
    if bitmask is not None:
        apply_bitmask(out, bitmask)
    return out


def _apply_penalties(rows: torch.Tensor, seq: Sequence, drafts: list[int]) -> None:
    """In place on ``rows`` ``[n, V]``: row j counts the output so far plus ``drafts[:j]``."""
    sp = seq.sampling
    n, vocab = rows.shape
    device = rows.device
    output = torch.tensor(seq.output_ids, dtype=torch.int64)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(rows.dtype)
    counts = counts.expand(n, vocab).clone()  # [n, V]
    if n > 1:  # row j also holds drafts 0 .. j-1
        r = torch.tensor([j for j in range(1, n) for _ in range(j)], dtype=torch.int64)
        c = torch.tensor([drafts[i] for j in range(1, n) for i in range(j)], dtype=torch.int64)
        counts.index_put_((r, c), torch.ones(len(r), dtype=rows.dtype), accumulate=True)
    counts = counts.to(device)
    in_output = counts > 0
    if sp.repetition_penalty != 1.0:
        seen = in_output | _prompt_mask(seq, vocab).to(device)[None, :]
        penalised = torch.where(rows > 0, rows / sp.repetition_penalty,
                                rows * sp.repetition_penalty)
        rows.copy_(torch.where(seen, penalised, rows))
    if sp.frequency_penalty != 0.0:
        rows -= sp.frequency_penalty * counts
    if sp.presence_penalty != 0.0:
        rows -= sp.presence_penalty * in_output.to(rows.dtype)


def _prompt_mask(seq: Sequence, vocab: int) -> torch.Tensor:
    """``[V]`` bool: the tokens of the request's prompt (computed once per sequence)."""
    mask = getattr(seq, "_prompt_mask", None)
    if mask is None:
        mask = torch.zeros(vocab, dtype=torch.bool)
        ids = torch.tensor(seq.token_ids[:seq.num_prompt_tokens], dtype=torch.int64)
        mask[ids[ids < vocab]] = True
        seq._prompt_mask = mask
    return mask


def grammar_masks(seq: Sequence, drafts: list[int], vocab: int) -> torch.Tensor:
    """``[len(drafts) + 1, ceil(V / 32)]`` int32, xgrammar's packed token bitmask (bit ``t % 32``
    of word ``t // 32`` set: token t allowed) at each fed position, with the matcher advanced
    through the drafts before it; all set after a draft it refuses (that draft is rejected, so
    later positions are unused). The matcher ends where it started. One
    ``fill_next_token_bitmask`` per position into one buffer, no unpacking (as vLLM's structured
    output fills its batch bitmask)."""
    from specbatch.engine import grammar

    xgr = grammar._xgr()
    matcher = seq.matcher
    n = len(drafts) + 1
    bitmask = xgr.allocate_token_bitmask(n, vocab)  # all bits set: every token allowed
    num_accepted = 0
    stop_ids = matcher.stop_token_ids
    for j in range(n):
        if matcher.is_terminated():
            # finished JSON with nothing left to accept: only a stop id may follow, and
            # xgrammar allows those in the mask of the position that finishes, not after. A
            # stop id drafted here leaves the matcher as it is (plain decoding commits it
            # without advancing the matcher, ``commit``; with ignore_eos the row goes on), so
            # the next position is masked the same way; any other draft is rejected here.
            bitmask[j] = grammar.packed_tokens(stop_ids, vocab)
            if j == n - 1 or drafts[j] not in stop_ids:
                break
            continue
        matcher.fill_next_token_bitmask(bitmask, j)
        if j == n - 1 or not matcher.accept_token(drafts[j]):
            break
        num_accepted += 1
    if num_accepted:
        matcher.rollback(num_accepted)
    return bitmask


def valid_draft_prefix(seq: Sequence, draft: list[int]) -> int:
    """How many leading tokens of ``draft`` the row's grammar accepts (``len(draft)`` without a
    grammar). A draft token the grammar refuses is rejected in the verify step whatever the
    target says (the target's masked token there cannot equal it), so feeding it and the
    tokens after it costs the step without a chance of acceptance: the engine cuts the draft
    here before the verify step (vLLM v1 does the same: ``validate_tokens`` on the draft in
    its structured-output manager). Once the grammar is complete only stop ids fit (with
    ignore_eos the row goes on after one, so a run of them is kept). The matcher ends where it
    started (``rollback``); outputs do not change."""
    matcher = seq.matcher
    if matcher is None or not draft:
        return len(draft)
    stop_ids = matcher.stop_token_ids
    n = advanced = 0
    for tok in draft:
        if matcher.is_terminated():  # complete: only stop ids follow (grammar_masks)
            if tok not in stop_ids:
                break
            n += 1
            continue
        if not matcher.accept_token(tok):
            break
        n += 1
        advanced += 1
    if advanced:
        matcher.rollback(advanced)
    return n


def apply_bitmask(rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``-inf`` at the tokens ``bitmask`` (``grammar_masks``) leaves out. rows:
    ``[n, V]`` float32 / float16 / bfloat16 through xgrammar's kernel (CPU or CUDA); other
    dtypes (the float64 test models) unpacked here. Both write the same ``-inf`` entries."""
    vocab = rows.shape[-1]
    if rows.dtype in (torch.float32, torch.float16, torch.bfloat16) and rows.is_contiguous():
        from specbatch.engine import grammar

        grammar._xgr().apply_token_bitmask_inplace(rows, bitmask.to(rows.device),
                                                   vocab_size=vocab)
        return
    from specbatch.engine.grammar import unpack_bitmask

    rows.masked_fill_(~unpack_bitmask(bitmask, vocab).to(rows.device), float("-inf"))


def commit(seq: Sequence, new_ids: list[int]) -> None:
    """Advance the row's grammar matcher through the tokens just committed (no-op without one).
    A committed token the grammar refuses (only possible when every token was masked) ends the
    sequence with an error."""
    matcher = seq.matcher
    if matcher is None or not new_ids:
        return
    for i, tok in enumerate(new_ids):
        if matcher.is_terminated():
            break
        if not matcher.accept_token(tok):
            seq.finish_reason = "error"
            at = seq.num_output_tokens - len(new_ids) + i  # output tokens before ``tok``
            if at < seq.sampling.min_tokens and matcher.is_completed():
                seq.error = (f"min_tokens={seq.sampling.min_tokens} cannot be met: the "
                             f"response_format JSON is complete after {at} tokens and only a "
                             f"stop token may follow")
            else:
                seq.error = f"token {tok} does not fit the response_format grammar"
            return
