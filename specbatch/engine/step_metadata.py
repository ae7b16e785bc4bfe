"""The packed metadata of one engine step, built once on the host, copied to the device in one go.

A step feeds ``B`` rows; row ``b`` feeds ``num_fed[b] = 1 + len(drafts[b])`` tokens (its last
committed token, then its draft tokens), ``T = sum(num_fed)`` tokens in all. Every per-token
field is flat ``[T]`` in row-major order (row 0's tokens, then row 1's, ...), with the prefix sums
``cu_num_fed [B + 1]`` giving each row's slice, as vLLM's ``SpecDecodeMetadata`` does. The
forward runs ``[B, Q]`` ids (padded to the longest row, ``Q``); ``token_index [T]`` (``b * Q +
j``) places the fed tokens there and, where a backend returns padded logits ``[B, Q, V]``, picks
the fed queries' out of them without a host sync (``runner.verify`` returns ``[T, V]``).

Every field is written into one host int64 buffer (float64 fields bit-cast, exact) and copied to
the device with one copy (``_Packer``); the fields on the device are views of that buffer (on
the CPU, views of the host tensors, no copy). The results of the step come back with one
device-to-host copy (``fetch_step_results``).

Per-token sampling fields live in ``SamplingMetadata``: a new logits processor that needs a
per-token value (a penalty, ``min_p``, a bias) adds a field there and one line in
``SamplingMetadata.build``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from specbatch.engine.sequence import Sequence, StopRules

DRAFT_PAD_ID = -1  # placeholder in padded draft_ids; never equal to a target token


class _Packer:
    """Host lists -> one int64 and one float64 host tensor -> named views; on another device
    than the CPU, the two as one int64 buffer (float64 bit-cast, exact) and one copy.

    Two ``torch.tensor`` calls a step, whatever the fields: one per field (and a copy of each
    into the buffer) took ~0.15 ms of a batch-1 step's ~0.3 ms of host work on the CPU (EPYC
    Zen 4), where the fields need no copy at all.
    """

    def __init__(self) -> None:
        self._values: dict[torch.dtype, list] = {torch.int64: [], torch.float64: []}
        # name, dtype, start and length in its dtype's list, shape
        self._parts: list[tuple[str, torch.dtype, int, int, tuple[int, ...]]] = []

    def add(self, name: str, values, dtype: torch.dtype = torch.int64,
            shape: tuple[int, ...] | None = None) -> None:
        """values: a flat sequence of ints (or floats where dtype is float64); shape: its
        shape (default: flat)."""
        vals = self._values[dtype]
        start = len(vals)
        vals.extend(values)
        n = len(vals) - start
        self._parts.append((name, dtype, start, n, (n,) if shape is None else shape))

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        ints = torch.tensor(self._values[torch.int64], dtype=torch.int64, device="cpu")
        floats = torch.tensor(self._values[torch.float64], dtype=torch.float64, device="cpu")
        if device.type != "cpu":
            host = torch.cat([ints, floats.view(torch.int64)])
            if device.type == "cuda":
                buf = host.pin_memory().to(device, non_blocking=True)
            else:
                buf = host.to(device)
            ints, floats = buf[:ints.numel()], buf[ints.numel():].view(torch.float64)
        src = {torch.int64: ints, torch.float64: floats}
        return {name: src[dtype][start:start + n].view(shape)
                for name, dtype, start, n, shape in self._parts}


@dataclass
class SamplingMetadata:
    """Per-token sampling parameters of a step, on the device.

    temperature: ``[T]`` float64 (0 = greedy); top_k: ``[T]`` int64 (0 = off); top_p: ``[T]``
    float64 (1 = off); seeds: ``[T]`` int64 record seeds; output_positions: ``[T]`` int64, the
    output position (0-based, tokens) each fed token's target token will take: the Gumbel
    noise key. banned_token / banned_id: ``[num_banned]`` int64 pairs (flat token index, vocab
    id) that may not be sampled (EOS and stop ids before ``min_tokens``). min_p: ``[T]`` float64
    (0 = off).
    Host flags (no device sync needed to branch on them): all_greedy, any_top_k_p, num_banned,
    any_min_p.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    output_positions: torch.Tensor
    banned_token: torch.Tensor
    banned_id: torch.Tensor
    min_p: torch.Tensor
    all_greedy: bool
    any_top_k_p: bool
    num_banned: int
    any_min_p: bool = False

    FIELDS = ("temperature", "top_k", "top_p", "seeds", "output_positions", "banned_token",
              "banned_id", "min_p")

    @staticmethod
    def add_fields(pack: _Packer, seqs: list[Sequence], num_fed: list[int],
                   stop_rules: StopRules | None) -> dict:
        """Append this step's per-token sampling fields to ``pack``; returns the host flags.
        stop_rules None: no bans (a forward-only step)."""
        temps, top_k, top_p, seeds, positions, ban_tok, ban_id = [], [], [], [], [], [], []
        min_p = []
        tok = 0
        for seq, n in zip(seqs, num_fed):
            sp = seq.sampling
            for j in range(n):
                t = seq.num_output_tokens + j
                temps.append(sp.temperature)
                top_k.append(sp.top_k)
                top_p.append(sp.top_p)
                min_p.append(sp.min_p)
                seeds.append(seq.request.seed)
                positions.append(t)
                if t < sp.min_tokens and stop_rules is not None:
                    for v in sorted(stop_rules.stop_ids(sp)):
                        ban_tok.append(tok)
                        ban_id.append(v)
                tok += 1
        pack.add("temperature", temps, torch.float64)
        pack.add("top_k", top_k)
        pack.add("top_p", top_p, torch.float64)
        pack.add("seeds", seeds)
        pack.add("output_positions", positions)
        pack.add("banned_token", ban_tok)
        pack.add("banned_id", ban_id)
        pack.add("min_p", min_p, torch.float64)
        return {"all_greedy": all(t == 0 for t in temps),
                "any_top_k_p": any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
                "num_banned": len(ban_tok),
                "any_min_p": any(p > 0 for p in min_p)}

    def banned_mask(self, num_tokens: int, vocab_size: int) -> torch.Tensor | None:
        """``[T, V]`` bool on the device, True where a token is banned; None if none is."""
        if self.num_banned == 0:
            return None
        mask = torch.zeros((num_tokens, vocab_size), dtype=torch.bool,
                           device=self.banned_token.device)
        mask[self.banned_token, self.banned_id] = True
        return mask


@dataclass
class StepMetadata:
    """Everything a step's forward, sampling and acceptance need, on the device.

    Host values: num_rows (B), query_len (Q, the padded queries per row of the forward's
    logits), num_fed (``list[int]``, tokens fed per row), max_position (largest padded
    position, tokens).
    Device tensors: input_ids ``[T]`` int64; positions ``[T]`` int64 absolute cache positions;
    cu_num_fed ``[B + 1]`` int64; token_index ``[T]`` int64 (``b * Q + j``); rows ``[B]``
    int64 cache rows; starts ``[B]`` int64 (position of each row's first fed token);
    draft_ids ``[B, max(1, K)]`` int64 padded with ``DRAFT_PAD_ID``; num_draft ``[B]`` int64;
    sampling: ``SamplingMetadata``.
    """

    num_rows: int
    query_len: int
    num_fed: list[int]
    max_position: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_num_fed: torch.Tensor
    token_index: torch.Tensor
    rows: torch.Tensor
    starts: torch.Tensor
    draft_ids: torch.Tensor
    num_draft: torch.Tensor
    sampling: SamplingMetadata

    @property
    def num_tokens(self) -> int:
        return sum(self.num_fed)

    def grid(self, values: torch.Tensor, fill) -> torch.Tensor:
        """``[B, Q]``: per-position ``values`` ``[T]`` (row order) at their fed slots
        (``token_index``), ``fill`` in the padded ones."""
        out = torch.full((self.num_rows * self.query_len,), fill, dtype=values.dtype,
                         device=values.device)
        out[self.token_index] = values
        return out.view(self.num_rows, self.query_len)

    @property
    def cu_num_fed_host(self) -> list[int]:
        """``cu_num_fed`` on the host: ``[0, num_fed[0], num_fed[0] + num_fed[1], ...]``."""
        return list(itertools.accumulate(self.num_fed, initial=0))

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @classmethod
    def build(cls, seqs: list[Sequence], drafts: list[list[int]], stop_rules: StopRules | None,
              device: torch.device, query_len: int | None = None) -> StepMetadata:
        """Pack a step: row i feeds ``[seqs[i].token_ids[-1], *drafts[i]]``.

        query_len: Q, the forward's padded queries per row (default ``1 + max draft length``);
        the runner may pad further (see ``ModelRunner.query_len``).
        """
        num_fed = [1 + len(d) for d in drafts]
        q = max(num_fed) if query_len is None else query_len
        assert q >= max(num_fed), (q, num_fed)
        k = max(1, max(num_fed) - 1)
        input_ids, positions, token_index, starts, draft_ids, cu = [], [], [], [], [], [0]
        for b, (seq, draft) in enumerate(zip(seqs, drafts)):
            start = len(seq.token_ids) - 1
            input_ids += [seq.token_ids[-1], *draft]
            positions += range(start, start + 1 + len(draft))
            token_index += range(b * q, b * q + 1 + len(draft))
            starts.append(start)
            draft_ids += [*draft, *[DRAFT_PAD_ID] * (k - len(draft))]
            cu.append(cu[-1] + 1 + len(draft))
        pack = _Packer()
        pack.add("input_ids", input_ids)
        pack.add("positions", positions)
        pack.add("cu_num_fed", cu)
        pack.add("token_index", token_index)
        pack.add("rows", [s.row for s in seqs])
        pack.add("starts", starts)
        pack.add("draft_ids", draft_ids, shape=(len(seqs), k))
        pack.add("num_draft", [len(d) for d in drafts])
        flags = SamplingMetadata.add_fields(pack, seqs, num_fed, stop_rules)
        t = pack.to(device)
        sampling = SamplingMetadata(**{f: t.pop(f) for f in SamplingMetadata.FIELDS}, **flags)
        return cls(num_rows=len(seqs), query_len=q, num_fed=num_fed,
                   max_position=max(starts) + q - 1, sampling=sampling, **t)


@dataclass
class StepResults:
    """A step's results on the host: accepted draft tokens per row, whether the row's logits
    held a NaN, and the target's token at each fed position (``target_ids[b][:num_fed[b]]``)."""

    num_accepted: list[int]
    has_nan: list[bool]
    target_ids: list[list[int]]


def fetch_step_results(num_accepted: torch.Tensor, has_nan: torch.Tensor,
                       target: torch.Tensor) -> StepResults:
    """One device-to-host copy. num_accepted: ``[B]`` int64; has_nan: ``[B]`` bool; target:
    ``[B, Q]`` int64 (padded slots hold anything)."""
    bsz, q = target.shape
    host = torch.cat([num_accepted, has_nan.to(torch.int64), target.reshape(-1)]).cpu().tolist()
    return StepResults(host[:bsz], [bool(x) for x in host[bsz:2 * bsz]],
                       [host[2 * bsz + b * q:2 * bsz + (b + 1) * q] for b in range(bsz)])
