"""The engine loop: schedule, propose, verify, commit.

``Engine.generate(requests)`` runs requests through continuous batching over the runner's cache
rows and yields a ``Completion`` as each finishes. One step:

    admit waiting requests into free rows and prefill them (each emits its first token)
    propose draft tokens for every running row (a row may get none)
    verify: one target forward over [last token, drafts...] of every row
    sample the target's token at every fed position (position-keyed, see spec_decode.sampler)
    accept the matching draft prefix, commit it plus the recovered/bonus token token by token
    through the stop rules, roll the KV rows back to the committed length

With ``k = 0`` this is plain decoding, the baseline every comparison uses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from specbatch.engine.runner import ModelRunner
from specbatch.engine.scheduler import Scheduler
from specbatch.engine.sequence import LogprobEntry, Request, Sequence, StopRules
from specbatch.spec_decode import sampler
from specbatch.spec_decode.caps import draft_cap
from specbatch.spec_decode.proposer import Proposer
from specbatch.spec_decode.stats import SpecStats
from specbatch.spec_decode.verify import count_accepted


@dataclass
class Completion:
    """A finished request. ``output_ids`` include a final EOS / stop id (``text`` does not)."""

    request: Request
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "error"
    stop_reason: int | str | None
    error: str | None
    stats: SpecStats
    logprobs: list[LogprobEntry] | None


class Engine:
    """Batched speculative decoding over one target model.

    k: draft tokens per verify step (a request's ``max_k`` or the planner may lower it per row).
    follow_up: called with each completion; a returned ``Request`` (e.g. the next turn) is
    queued ahead of the others.
    """

    def __init__(self, runner: ModelRunner, proposer: Proposer, stop_rules: StopRules, k: int,
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        self.runner = runner
        self.proposer = proposer
        self.stop_rules = stop_rules
        self.k = k
        self.detokenize = detokenize or stop_rules.detokenize
        self.scheduler = Scheduler(runner.cache.num_rows)
        self.follow_up: Callable[[Completion], Request | None] | None = None
        # planner hook (``plan.policy.AdaptivePolicy``): select(seqs, drafts, caps) cuts the
        # proposed drafts (caps: the most each row may draft this step); observe_step(seqs, drafts, seconds), optional, times the verify step;
        # observe(seq, proposed, emitted) learns acceptance; finish(seq) forgets
        self.policy = None

    # ---- public -------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request],
                 follow_up: Callable[[Completion], Request | None] | None = None,
                 ) -> Iterator[Completion]:
        self.follow_up = follow_up
        for r in requests:
            self.scheduler.add(r)
        while self.scheduler.has_work:
            yield from self.step()

    def step(self) -> list[Completion]:
        done = self._admit()
        running = [s for s in self.scheduler.running_sequences() if s.is_prefilled]
        if running:
            ks = self._draft_caps(running)
            proposed = [d[:k] for d, k in zip(self.proposer.propose(running, ks), ks)]
            drafts = self.policy.select(running, proposed, ks) if self.policy else proposed
            t0 = time.perf_counter()
            logits = self.runner.verify(running, drafts)
            observe_step = getattr(self.policy, "observe_step", None)
            if observe_step is not None:  # the policy's cost model learns this machine's steps
                observe_step(running, drafts, time.perf_counter() - t0)
            done += self._commit_step(running, drafts, logits, proposed=proposed)
        return done

    # ---- stages -------------------------------------------------------------------------
    def _admit(self) -> list[Completion]:
        """Admit waiting requests into free rows and prefill: one packed forward of prompt
        chunks per step while other rows are decoding (a long prompt cannot stall them for
        long), as many as needed while none is. A prompt that cannot fit the context fails its
        record here, and a row freed at once (e.g. max_tokens = 1) is refilled."""
        done = []
        while True:
            while self.scheduler.waiting and self.scheduler.free_rows:
                for seq in self.scheduler.admit(self._make_sequence):
                    if seq.num_prompt_tokens >= self.runner.max_model_len:
                        seq.finish_reason = "error"
                        seq.error = (f"prompt is {seq.num_prompt_tokens} tokens; the model's "
                                     f"context is {self.runner.max_model_len}")
                        done.append(self._finish(seq))
            running = self.scheduler.running_sequences()
            prefilling = [s for s in running if not s.is_prefilled]
            if not prefilling:
                return done
            ready, logits = self.runner.prefill_step(prefilling)  # [len(ready), V]
            if ready:
                done += self._commit_step(ready, [[] for _ in ready], logits[:, None, :],
                                          is_prefill=True)
            if any(s.is_prefilled and not s.is_finished for s in running):
                return done  # rows are decoding: the rest of the prefill waits a step

    def _draft_caps(self, seqs: list[Sequence]) -> list[int]:
        """Draft length per row: its k, capped so the step cannot pass ``max_tokens`` or the
        context (emits at most k + 1 tokens)."""
        return [draft_cap(s.k, s.sampling.max_tokens, s.num_output_tokens,
                          self.runner.max_model_len, len(s.token_ids))
                for s in seqs]

    def _commit_step(self, seqs: list[Sequence], drafts: list[list[int]], logits: torch.Tensor,
                     is_prefill: bool = False,
                     proposed: list[list[int]] | None = None) -> list[Completion]:
        """Sample the target at every fed position, accept, commit, roll back.

        logits: ``[B, Q, vocab]``; row i uses its first ``len(drafts[i]) + 1`` queries.
        proposed: the drafts before the policy cut them (what the policy learns from).
        """
        num_fed = [len(d) + 1 for d in drafts]
        target_ids, scaled = self._sample(seqs, logits, num_fed)
        qlen = logits.shape[1]
        target = torch.zeros((len(seqs), qlen), dtype=torch.int64)
        offsets = [0]
        for i, n in enumerate(num_fed):
            target[i, :n] = target_ids[offsets[-1]:offsets[-1] + n]
            offsets.append(offsets[-1] + n)
        k_max = max(num_fed) - 1
        draft_ids = torch.full((len(seqs), k_max), -1, dtype=torch.int64)
        for i, d in enumerate(drafts):
            draft_ids[i, :len(d)] = torch.tensor(d, dtype=torch.int64)
        num_accepted = count_accepted(target, draft_ids, torch.tensor(num_fed) - 1).tolist()
        bad_rows = torch.isnan(logits).flatten(1).any(dim=1).tolist()

        done = []
        for i, seq in enumerate(seqs):
            if bad_rows[i]:
                seq.finish_reason, seq.error = "error", "NaN in the target's logits"
                self.runner.clear_row(seq.row)  # its NaN keys/values must not outlive it
                done.append(self._finish(seq))
                continue
            emitted = target[i, :num_accepted[i] + 1].tolist()
            num_before = seq.num_output_tokens
            num_committed = self.stop_rules.commit(seq, emitted)
            if not is_prefill:
                seq.stats.record_step(len(drafts[i]), min(num_accepted[i], num_committed))
            else:
                seq.stats.num_steps += 1
            if seq.sampling.logprobs is not None:
                self._add_logprobs(seq, scaled[offsets[i]:offsets[i] + num_committed],
                                   emitted[:num_committed])
            if is_prefill:
                self.proposer.start(seq)
            else:
                if self.policy is not None and proposed is not None:
                    self.policy.observe(seq, proposed[i], emitted[:num_committed])
                self.proposer.on_commit(seq, seq.num_output_tokens - num_before)
                self.runner.rollback(seq)
            if seq.is_finished:
                done.append(self._finish(seq))
        return done

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor,
                num_fed: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Target tokens at the fed positions of every row, flattened row-major: ``[sum num_fed]``."""
        rows = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(num_fed))
        cols = torch.cat([torch.arange(n) for n in num_fed])
        flat = logits[rows, cols].float() if logits.dtype != torch.float64 else logits[rows, cols]
        temps, top_k, top_p, seeds, positions, bans = [], [], [], [], [], []
        any_ban = False
        for seq, n in zip(seqs, num_fed):
            sp = seq.sampling
            for j in range(n):
                t = seq.num_output_tokens + j
                temps.append(sp.temperature)
                top_k.append(sp.top_k)
                top_p.append(sp.top_p)
                seeds.append(seq.request.seed)
                positions.append(t)
                ban = t < sp.min_tokens
                any_ban |= ban
                bans.append(self.stop_rules.stop_ids(sp) if ban else ())
        banned = None
        if any_ban:
            banned = torch.zeros(flat.shape, dtype=torch.bool)
            for r, ids in enumerate(bans):
                if ids:
                    banned[r, list(ids)] = True
        return sampler.sample(flat, torch.tensor(temps, dtype=torch.float64),
                              torch.tensor(top_k, dtype=torch.int64),
                              torch.tensor(top_p, dtype=torch.float64),
                              torch.tensor(seeds, dtype=torch.int64),
                              torch.tensor(positions, dtype=torch.int64), banned)

    def _add_logprobs(self, seq: Sequence, scaled: torch.Tensor, ids: list[int]) -> None:
        """scaled: ``[n, V]`` logits / T (logits at T = 0) at the committed positions."""
        if not ids:
            return
        logp = torch.log_softmax(scaled.double(), dim=-1)
        n_top = seq.sampling.logprobs
        top_vals, top_ids = (torch.topk(logp, n_top, dim=-1) if n_top else (None, None))
        for j, tok in enumerate(ids):
            top = ([(int(a), _finite(float(b))) for a, b in zip(top_ids[j], top_vals[j])]
                   if n_top else [])
            seq.logprobs.append(LogprobEntry(tok, _finite(float(logp[j, tok])), top))

    def _make_sequence(self, request: Request) -> Sequence:
        k = self.k if request.max_k is None else min(self.k, request.max_k)
        return Sequence(request, self.proposer.name, k)

    def _finish(self, seq: Sequence) -> Completion:
        self.proposer.finish(seq)
        if self.policy is not None:
            self.policy.finish(seq)
        self.scheduler.release(seq)
        out = seq.output_ids
        # the final EOS / stop id stays in output_ids but not in the text (a stop id may be an
        # ordinary token, which the detokenizer would not skip)
        text_ids = out[:-1] if isinstance(seq.stop_reason, int) else out
        text = ""
        if self.detokenize is not None and text_ids:
            text = self.detokenize(text_ids)
            if seq.stop_text_end is not None:
                text = text[:seq.stop_text_end]
        c = Completion(seq.request, seq.token_ids[:seq.num_prompt_tokens], out, text,
                       seq.finish_reason, seq.stop_reason, seq.error, seq.stats,
                       seq.logprobs if seq.sampling.logprobs is not None else None)
        if self.follow_up is not None and seq.finish_reason != "error":
            nxt = self.follow_up(c)
            if nxt is not None:
                self.scheduler.add(nxt, front=True)
        return c


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
