"""Position-keyed Gumbel-max sampling fused with draft acceptance.

Per fed token t (row b, query j): the target's token is

    argmax_v( logits[t, v] / T_t + g(seed_t, pos_t, v) )     (T_t > 0; top-k / top-p kept set)
    argmax_v( logits[t, v] )                                 (T_t = 0)

with bans (-inf) applied first and ties to the lowest id; then row b accepts its drafts while
they equal the target's tokens. This is ``specbatch.spec_decode.sampler.sample`` followed by
``sampler.count_accepted`` (the reference below calls exactly those), in one kernel: one program
per row walks its fed tokens in order, each over the vocabulary in blocks of ``BLOCK_V``.

Exactness: the noise hash (lowbias32, see ``sampler``) is integer arithmetic, done here in int64
with the same masked steps as the torch code, so its bits are identical; ``logits / T`` is one
IEEE float64 division on both sides. The only floating-point difference is
``g = -log(-log(u))`` in float64: the torch reference uses the host's libm / SLEEF ``log``, a
CUDA kernel libdevice's ``log`` (max error 1 ulp each), so ``g`` may differ by a few float64 ulp
(relative ~1e-15). A sampled id can change only where two perturbed scores lie within that of
each other, ~1e-13 of the way apart for logits of order 10: never seen in the tests, far rarer
than the 1-ulp logit near-ties every cross-device comparison already has (docs/design.md).
Under ``TRITON_INTERPRET=1`` numpy's ``log`` is used.

Top-k / top-p: the kept set of every row is a prefix of the stable descending sort, so the
launcher (torch, on the device, only when a row uses them) turns it into a threshold per token:
keep v iff ``s > thr`` or ``s == thr and v <= id_cut`` (``top_k_top_p_cut``); the kernel applies
it while it scans the vocabulary.
"""

from __future__ import annotations

import torch

from . import check

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None

BLOCK_V = 1024  # vocabulary ids per block of the scan
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


if triton is not None:
    @triton.jit
    def _mul32(x, c):
        """(x * c) mod 2**32 for int64 x in [0, 2**32); as sampler._mul32."""
        lo = (x & 0xFFFF) * c
        hi = ((x >> 16) * c) & 0xFFFF
        return (lo + (hi << 16)) & 0xFFFFFFFF

    @triton.jit
    def _mix32(x):
        """lowbias32 on int64 holding uint32 values; as sampler.mix32."""
        x = x ^ (x >> 16)
        x = _mul32(x, 0x7FEB352D)
        x = x ^ (x >> 15)
        x = _mul32(x, 0x846CA68B)
        return x ^ (x >> 16)

    @triton.jit
    def _sample_accept_kernel(
            logits_ptr, s_lt,  # [T, V] float32/float64, the fed positions (vocab stride 1)
            cu_ptr,  # [B + 1] int64 cu_num_fed
            draft_ptr, s_db,  # [B, K] int64 draft ids
            num_draft_ptr,  # [B] int64
            temp_ptr, seed_ptr, opos_ptr,  # [T] float64, int64, int64
            ban_ptr,  # [T, V] bool (HAS_BAN)
            thr_ptr, cut_ptr,  # [T] float64, int64 (HAS_CUT)
            target_ptr, s_tb,  # [B, Q] int64 out
            accepted_ptr,  # [B] int64 out
            V, HAS_BAN: tl.constexpr, HAS_CUT: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        start = tl.load(cu_ptr + b)
        num_fed = tl.load(cu_ptr + b + 1) - start
        num_draft = tl.load(num_draft_ptr + b)
        still = num_draft >= 0  # all drafts so far accepted
        accepted = num_draft * 0
        offs = tl.arange(0, BLOCK)
        for j in range(0, num_fed):
            t = start + j
            temp = tl.load(temp_ptr + t)
            greedy = temp == 0.0
            div = tl.where(greedy, 1.0, temp)
            seed = tl.load(seed_ptr + t)
            key = _mix32((tl.load(opos_ptr + t) & 0xFFFFFFFF) ^ 0x9E3779B9)
            key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF))
            key = _mix32((key + (seed & 0xFFFFFFFF)) & 0xFFFFFFFF)
            if HAS_CUT:
                thr = tl.load(thr_ptr + t)
                cut = tl.load(cut_ptr + t)
            best_val = tl.full((), float("-inf"), tl.float64)
            best_id = num_draft * 0
            row_ptr = logits_ptr + t * s_lt
            for v0 in range(0, V, BLOCK):
                v = v0 + offs
                vmask = v < V
                x = tl.load(row_ptr + v, mask=vmask, other=float("-inf")).to(tl.float64)
                s = x / div
                if HAS_BAN:
                    banned = tl.load(ban_ptr + t * V + v, mask=vmask, other=0)
                    s = tl.where(banned != 0, float("-inf"), s)
                if HAS_CUT:
                    s = tl.where((s > thr) | ((s == thr) & (v <= cut)), s, float("-inf"))
                h = _mix32(key ^ _mix32(v.to(tl.int64)))
                u = ((h >> 8).to(tl.float64) + 0.5) * (1.0 / 16777216.0)
                noise = -tl.log(-tl.log(u))
                s = tl.where(greedy, s, s + noise)
                s = tl.where(vmask, s, float("-inf"))
                blk_max = tl.max(s, axis=0)
                blk_id = tl.min(tl.where(s == blk_max, v, 2147483647), axis=0).to(tl.int64)
                better = blk_max > best_val  # strict: an earlier block keeps a tie
                best_id = tl.where(better, blk_id, best_id)
                best_val = tl.where(better, blk_max, best_val)
            tl.store(target_ptr + b * s_tb + j, best_id)
            if j < num_draft:
                still = still & (tl.load(draft_ptr + b * s_db + j) == best_id)
                accepted += still.to(tl.int64)
        tl.store(accepted_ptr + b, accepted)


def top_k_top_p_cut(scaled: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept set of ``sampler.mask_top_k_top_p`` as a threshold per row.

    scaled: ``[T, V]`` float64 (logits / T, bans applied); top_k: ``[T]`` int64; top_p: ``[T]``
    float64. Returns (thr ``[T]`` float64, id_cut ``[T]`` int64): v is kept iff
    ``scaled[v] > thr`` or ``scaled[v] == thr and v <= id_cut``. Exact, because the kept set is
    a prefix of the stable descending order (ties: lower id first).
    """
    from specbatch.spec_decode.sampler import mask_top_k_top_p

    kept = mask_top_k_top_p(scaled, top_k, top_p) > float("-inf")
    kept |= scaled == float("-inf")  # a -inf logit stays -inf either way
    inf = torch.tensor(float("inf"), dtype=scaled.dtype, device=scaled.device)
    thr = torch.where(kept & (scaled > float("-inf")), scaled, inf).amin(dim=1)
    ids = torch.arange(scaled.shape[1], device=scaled.device)[None, :]
    cut = torch.where(kept & (scaled == thr[:, None]), ids, -1).amax(dim=1)
    return thr, cut


def sample_accept(logits: torch.Tensor, cu_num_fed: torch.Tensor, draft_ids: torch.Tensor,
                  num_draft: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, seeds: torch.Tensor, output_positions: torch.Tensor,
                  banned: torch.Tensor | None = None, any_top_k_p: bool = True,
                  query_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher: the target's token at every fed position, and accepted drafts per row.

    logits: ``[T, V]`` float32 / float64 (vocab dim contiguous), the fed positions' logits in
    row order (``runner.verify``): row b feeds ``num_fed[b] = cu_num_fed[b + 1] -
    cu_num_fed[b]`` tokens, its logits rows ``cu_num_fed[b] .. cu_num_fed[b + 1] - 1``.
    cu_num_fed: ``[B + 1]`` int64; draft_ids: ``[B, K]`` int64 (padded with any id that is not
    a token, e.g. -1); num_draft: ``[B]`` int64 (``num_fed - 1``). temperature ``[T]`` float64,
    top_k ``[T]`` int64, top_p ``[T]`` float64, seeds ``[T]`` int64 (record seed),
    output_positions ``[T]`` int64 (the noise key), flat row-major. banned: optional ``[T, V]``
    bool. any_top_k_p: False skips the top-k / top-p pre-pass (a host flag: no sync to find
    out). query_len: Q of the target grid, at least the longest row's ``num_fed`` (default
    ``K + 1``).
    Returns (target ids ``[B, Q]`` int64, padded slots -1; accepted ``[B]`` int64).
    Raises ``ValueError`` for a shape, dtype, device or layout mismatch.
    """
    _check_args(logits, cu_num_fed, draft_ids, num_draft, temperature, top_k, top_p, seeds,
                output_positions, banned)
    bsz, vocab = num_draft.shape[0], logits.shape[1]
    qlen = draft_ids.shape[1] + 1 if query_len is None else query_len
    target = torch.full((bsz, qlen), -1, dtype=torch.int64, device=logits.device)
    accepted = torch.empty(bsz, dtype=torch.int64, device=logits.device)
    thr = cut = temperature  # unused unless HAS_CUT
    if any_top_k_p:
        scaled = logits.double()
        if banned is not None:
            scaled = scaled.masked_fill(banned, float("-inf"))
        greedy = temperature == 0
        scaled = scaled / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
        thr, cut = top_k_top_p_cut(scaled, top_k, top_p)
    _sample_accept_kernel[(bsz,)](
        logits, logits.stride(0), cu_num_fed, draft_ids,
        draft_ids.stride(0), num_draft, temperature, seeds, output_positions,
        banned if banned is not None else temperature, thr, cut, target, target.stride(0),
        accepted, vocab, HAS_BAN=banned is not None, HAS_CUT=any_top_k_p, BLOCK=BLOCK_V)
    return target, accepted


def sample_accept_reference(logits: torch.Tensor, cu_num_fed: torch.Tensor,
                            draft_ids: torch.Tensor, num_draft: torch.Tensor,
                            temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            seeds: torch.Tensor, output_positions: torch.Tensor,
                            banned: torch.Tensor | None = None, any_top_k_p: bool = True,
                            query_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, same contract as ``sample_accept``: ``sampler.sample`` on the fed positions,
    then ``sampler.count_accepted`` (the engine's torch path)."""
    from specbatch.spec_decode.sampler import count_accepted, sample

    bsz, t = num_draft.shape[0], temperature.shape[0]
    qlen = draft_ids.shape[1] + 1 if query_len is None else query_len
    rows = torch.repeat_interleave(torch.arange(bsz, device=logits.device), cu_num_fed.diff(),
                                   output_size=t)
    cols = torch.arange(t, device=logits.device) - cu_num_fed[rows]
    ids, _ = sample(logits, temperature, top_k, top_p, seeds, output_positions,
                    banned)
    target = torch.full((bsz, qlen), -1, dtype=torch.int64, device=logits.device)
    target[rows, cols] = ids
    return target, count_accepted(target, draft_ids, num_draft)


def _check_args(logits, cu_num_fed, draft_ids, num_draft, temperature, top_k, top_p, seeds,
                output_positions, banned) -> None:
    check(triton is not None, "sample_accept needs triton (pip install 'specbatch[gpu]')")
    check(logits.dim() == 2, f"logits: [T, V], got {tuple(logits.shape)}")
    check(logits.dtype in (torch.float32, torch.float64),
          f"logits: float32 or float64, got {logits.dtype}")
    check(logits.stride(1) == 1, "logits: vocab dim contiguous")
    bsz, vocab = num_draft.shape[0], logits.shape[1]
    check(logits.shape[0] == temperature.shape[0],
          f"logits: [{temperature.shape[0]}, V] (a row per fed position), got "
          f"{tuple(logits.shape)}")
    check(cu_num_fed.shape == (bsz + 1,), f"cu_num_fed: [{bsz + 1}], got "
          f"{tuple(cu_num_fed.shape)}")
    check(draft_ids.dim() == 2 and draft_ids.shape[0] == bsz and draft_ids.stride(1) == 1,
          f"draft_ids: [{bsz}, K], last dim contiguous, got {tuple(draft_ids.shape)}")
    check(num_draft.shape == (bsz,), f"num_draft: [{bsz}], got {tuple(num_draft.shape)}")
    t = temperature.shape[0]
    for name, x, dtype in (("temperature", temperature, torch.float64),
                           ("top_k", top_k, torch.int64), ("top_p", top_p, torch.float64),
                           ("seeds", seeds, torch.int64),
                           ("output_positions", output_positions, torch.int64),
                           ("cu_num_fed", cu_num_fed, torch.int64),
                           ("draft_ids", draft_ids, torch.int64),
                           ("num_draft", num_draft, torch.int64)):
        check(x.dtype == dtype, f"{name}: {dtype}, got {x.dtype}")
        check(x.device == logits.device, f"{name} on {x.device}, logits on {logits.device}")
        if x.dim() == 1:
            check(x.is_contiguous(), f"{name}: contiguous")
            if name not in ("cu_num_fed", "num_draft"):
                check(x.shape == (t,), f"{name}: [{t}], got {tuple(x.shape)}")
    if banned is not None:
        check(banned.shape == (t, vocab) and banned.dtype == torch.bool
              and banned.is_contiguous() and banned.device == logits.device,
              f"banned: [{t}, {vocab}] bool, contiguous, on the logits' device")
