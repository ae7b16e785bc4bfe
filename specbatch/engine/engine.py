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

from specbatch.config import prompt_too_long_text
from specbatch.engine import logits as logits_processing
from specbatch.engine.runner import ModelRunner
from specbatch.engine.scheduler import Scheduler
from specbatch.engine.sequence import LogprobEntry, Request, Sequence, StopRules
from specbatch.engine.step_metadata import StepMetadata, StepResults, fetch_step_results
from specbatch.spec_decode.caps import draft_cap
from specbatch.spec_decode.proposer import Proposer
from specbatch.spec_decode.stats import SpecStats
from specbatch.spec_decode.verify import greedy_accept, sample_and_accept


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
    prompt_fed: bool = True  # False when the prompt was refused before prefill (too long)
    # where it ran (engine steps, from 1): {"admit", "verify", "finish", "row", "phase"}; a
    # resumed job replays it (``sequence.Replay``)
    schedule: dict | None = None


class Engine:
    """Batched speculative decoding over one target model.

    k: the per-row draft cap (tokens; a request's ``max_k`` or the planner may lower it per
    row). num_speculative_tokens: the k the run asked for, recorded in each completion's stats
    beside the cap (``SpecStats``); None: ``k`` (the cap is k except for suffix drafts,
    ``SpecConfig.draft_cap``).
    follow_up: called with each completion; a returned ``Request`` (e.g. the next turn) is
    queued ahead of the others.
    limit_setting: the setting that capped the context below the model's own
    (``--max-model-len``), named in errors; None: the cap is the model's context.
    """

    def __init__(self, runner: ModelRunner, proposer: Proposer, stop_rules: StopRules, k: int,
                 detokenize: Callable[[list[int]], str] | None = None,
                 num_speculative_tokens: int | None = None,
                 limit_setting: str | None = None) -> None:
        self.runner = runner
        self.limit_setting = limit_setting
        self.proposer = proposer
        self.stop_rules = stop_rules
        self.k = k
        self.num_speculative_tokens = (k if num_speculative_tokens is None
                                       else num_speculative_tokens)
        self.detokenize = detokenize or stop_rules.detokenize
        self.scheduler = Scheduler(runner.cache.num_rows)
        self.follow_up: Callable[[Completion], Request | None] | None = None
        self.num_output_tokens = 0  # committed over every row so far (progress)
        self.step_index = 0  # steps so far; during a step, its number (from 1)
        self._phase = "admit"  # where a sequence finishing now finishes: "admit" | "verify"
        # placeholders (``Request.replay``) admitted at another step or row than recorded: the
        # schedule then differs from the interrupted run's (the stats may, outputs never)
        self.replay_mismatches = 0

    # ---- public -------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request],
                 follow_up: Callable[[Completion], Request | None] | None = None,
                 on_step: Callable[[int], None] | None = None) -> Iterator[Completion]:
        """on_step(num_output_tokens): after every step, the output tokens committed by this
        call so far, rows still running included (the progress bar's rate)."""
        self.follow_up = follow_up
        for r in requests:
            self.scheduler.add(r)
        base = self.num_output_tokens
        while self.scheduler.has_work:
            done = self.step()
            if on_step is not None:
                on_step(self.num_output_tokens - base)
            yield from done

    def step(self) -> list[Completion]:
        self.step_index += 1
        self._phase = "admit"
        done = self._admit()
        self._phase = "verify"
        rows = self.scheduler.running_sequences()
        running = [s for s in rows if s.is_prefilled and s.replay is None]
        ghosts = [s for s in rows if s.replay is not None]
        for s in running:
            if s.verify_step is None:
                s.verify_step = self.step_index
        if running:
            # a placeholder counts as a row of the verify step where its answer was one
            num_rows = len(running) + sum(g.replay.verify is not None
                                          and g.replay.verify <= self.step_index
                                          for g in ghosts)
            drafts = self._propose(running, num_rows)
            meta = StepMetadata.build(running, drafts, self.stop_rules, self.runner.device,
                                      self.runner.query_len(drafts))
            t0 = time.perf_counter()
            logits = self.runner.verify(running, drafts, meta)
            done += self._commit_step(running, drafts, logits, meta, ghosts=ghosts)
            # the proposer's hook after a verify step (auto's cost model learns from it)
            self.proposer.on_verify(running, drafts, time.perf_counter() - t0)
        else:
            self._release_ghosts(ghosts)
        return done

    def _release_ghosts(self, ghosts: list[Sequence], below_row: int | None = None) -> None:
        """Finish the placeholders of ``ghosts`` (row order) recorded to finish now, in this
        phase of the step (``below_row``: only those in lower rows, as the verify step's
        commit reaches each row in order): the row is freed, the answer joins the proposer's
        index (``proposer.finish``) and the next turn's placeholder is queued first."""
        for g in ghosts:
            r = g.replay
            if below_row is not None and g.row >= below_row:
                break
            if g.is_finished or r.finish != self.step_index or r.phase != self._phase:
                continue
            g.finish_reason = r.finish_reason
            self.proposer.finish(g)
            self.scheduler.release(g)
            if r.next is not None:
                self.scheduler.add(r.next, front=True)

    def _admitted_ghost(self, seq: Sequence) -> None:
        """A placeholder took a row: it holds it, without model work, for the steps its
        answer held one; at another step or row than recorded the replay has diverged (its
        steps are then shifted to start now, so it still ends)."""
        r = seq.replay
        if r.admit != self.step_index or r.row != seq.row:
            self.replay_mismatches += 1
            shift = self.step_index - r.admit
            r.admit, r.finish = self.step_index, r.finish + shift
            r.verify = None if r.verify is None else r.verify + shift

    # ---- stages -------------------------------------------------------------------------
    def _admit(self) -> list[Completion]:
        """Admit waiting requests into free rows and prefill: one packed forward of prompt
        chunks per step while other rows are decoding (a long prompt cannot stall them for
        long), as many as needed while none is. A prompt that cannot fit the context fails its
        record here, and a row freed at once (e.g. max_tokens = 1) is refilled."""
        done = []
        while True:
            while self.scheduler.waiting and self.scheduler.free_rows:
                admitted = self.scheduler.admit(self._make_sequence)
                for i, seq in enumerate(admitted):
                    seq.admit_step = self.step_index
                    if seq.replay is not None:
                        self._admitted_ghost(seq)
                        continue
                    # prefix caching: from rows that hold their own sequence's keys (not the
                    # rows admitted after this one, which still hold their last occupant's;
                    # not placeholders, which hold none)
                    waiting = {id(s) for s in admitted[i:]}
                    self.runner.start(seq, [s for s in self.scheduler.running_sequences()
                                            if id(s) not in waiting and s.replay is None])
                    if seq.num_prompt_tokens >= self.runner.max_model_len:
                        seq.finish_reason = "error"
                        seq.error = prompt_too_long_text(seq.num_prompt_tokens,
                                                         self.runner.max_model_len,
                                                         self.limit_setting)
                        done.append(self._finish(seq))
            rows = self.scheduler.running_sequences()
            running = [s for s in rows if s.replay is None]
            ghosts = [s for s in rows if s.replay is not None]
            # placeholders whose answer finished in this phase now (its prefill's first token
            # ended it, or its prompt was refused)
            due = [g for g in ghosts if g.replay.phase == "admit"
                   and g.replay.finish == self.step_index]
            # a resumed job's placeholders are charged their prompt's prefill as the run they
            # replay prefilled it (nothing computed), in row order with the real prompts, so
            # those prefill at the steps they did there (``ModelRunner.prefill_step``)
            charged = [s for s in rows if not s.is_finished and (
                (s.replay is None and not s.is_prefilled)
                or (s.replay is not None and s.prefill_charged < s.num_prompt_tokens
                    and s.num_prompt_tokens < self.runner.max_model_len))]
            if not charged and not due:
                return done
            if charged:
                ready, logits = self.runner.prefill_step(charged, others=running)  # [n, V]
                if ready:
                    no_drafts = [[] for _ in ready]
                    meta = StepMetadata.build(ready, no_drafts, self.stop_rules, logits.device)
                    done += self._commit_step(ready, no_drafts, logits, meta, is_prefill=True)
            self._release_ghosts(due)
            if (any(s.is_prefilled and not s.is_finished for s in running)
                    or any(g.replay.verify is not None and g.replay.verify <= self.step_index
                           and not g.is_finished for g in ghosts)):
                return done  # rows are decoding: the rest of the prefill waits a step

    @property
    def draining(self) -> bool:
        """Whether the job drains: no request waits for a row and no row's answer has a later
        turn, so a row that finishes frees its row for nothing and the rows left decode on
        (``auto.policy`` values an accepted draft token by it)."""
        return not self.scheduler.waiting and not any(
            s.request.follow_ups for s in self.scheduler.running.values())

    def _propose(self, seqs: list[Sequence], num_rows: int | None = None) -> list[list[int]]:
        """The drafts to verify, at most each row's cap (``_draft_caps``), cut before the
        first token a row's grammar refuses (``logits.valid_draft_prefix``). num_rows: the
        rows of the verify step, placeholders of a resumed job included (a proposer whose
        drafts depend on it, ``counts_rows``, is told; default ``len(seqs)``). A proposer that
        ``sees_drain`` is told ``draining``."""
        ks = self._draft_caps(seqs)
        kw: dict = {}
        if num_rows is not None and num_rows != len(seqs) and self.proposer.counts_rows:
            kw["num_rows"] = num_rows
        if getattr(self.proposer, "sees_drain", False):
            kw["draining"] = self.draining
        proposed = self.proposer.propose(seqs, ks, **kw)
        drafts = [d[:k] for d, k in zip(proposed, ks)]
        for i, seq in enumerate(seqs):  # a draft token the grammar refuses cannot be accepted
            if seq.matcher is not None and drafts[i]:
                drafts[i] = drafts[i][:logits_processing.valid_draft_prefix(seq, drafts[i])]
        return drafts

    def _draft_caps(self, seqs: list[Sequence]) -> list[int]:
        """Draft length per row: its k, capped so the step cannot pass ``max_tokens`` or the
        context (emits at most k + 1 tokens)."""
        return [draft_cap(s.k, s.sampling.max_tokens, s.num_output_tokens,
                          self.runner.max_model_len, len(s.token_ids))
                for s in seqs]

    def _commit_step(self, seqs: list[Sequence], drafts: list[list[int]], logits: torch.Tensor,
                     meta: StepMetadata, is_prefill: bool = False,
                     ghosts: list[Sequence] = ()) -> list[Completion]:
        """Sample the target at every fed position, accept, commit, roll back.

        logits: ``[T, vocab]``, the fed positions in row order (``runner.verify``): row i's
        ``len(drafts[i]) + 1`` of them, from ``meta.cu_num_fed_host[i]``.
        ghosts: a resumed job's placeholders (row order); those recorded to finish at this
        verify step finish in row order among the rows (``_release_ghosts``).
        Sampling and acceptance run on the logits' device; one copy brings the results back.
        """
        want_logprobs = any(s.sampling.logprobs is not None for s in seqs)
        bitmask = logits_processing.step_bitmask(seqs, drafts, logits.shape[-1])
        bias_or_penalties = logits_processing.needs_bias_or_penalties(seqs)
        greedy = None
        if not want_logprobs and not bias_or_penalties:
            greedy = greedy_accept(logits, meta, bitmask)  # all-greedy on the CPU: one pass
        if greedy is not None:
            res, scaled = StepResults(*greedy), None
        else:
            # grammar masks, logit_bias, penalties (engine.logits), when any row has them
            process = None
            if bitmask is not None or bias_or_penalties:
                def process(flat):
                    return logits_processing.process_logits(flat, seqs, drafts, bitmask)
            target, num_accepted, scaled = sample_and_accept(logits, meta, process,
                                                             want_logprobs)
            res = fetch_step_results(num_accepted, _rows_with_nan(logits, meta), target)
        if want_logprobs:
            scaled = scaled.cpu()
        offsets = meta.cu_num_fed_host

        done = []
        for i, seq in enumerate(seqs):
            if ghosts:
                self._release_ghosts(ghosts, below_row=seq.row)
            if res.has_nan[i]:
                seq.finish_reason, seq.error = "error", "NaN in the target's logits"
                self.runner.clear_row(seq.row)  # its NaN keys/values must not outlive it
                done.append(self._finish(seq))
                continue
            num_acc = res.num_accepted[i]
            emitted = res.target_ids[i][:num_acc + 1]
            num_before = seq.num_output_tokens
            num_committed = self.stop_rules.commit(seq, emitted)
            self.num_output_tokens += num_committed
            logits_processing.commit(seq, emitted[:num_committed])
            if not is_prefill:
                seq.stats.record_step(len(drafts[i]), min(num_acc, num_committed))
            else:
                seq.stats.num_steps += 1
            if seq.sampling.logprobs is not None:
                self._add_logprobs(seq, scaled[offsets[i]:offsets[i] + num_committed],
                                   emitted[:num_committed])
            if is_prefill:
                self.proposer.start(seq)
            else:
                self.proposer.on_commit(seq, seq.num_output_tokens - num_before)
                self.runner.rollback(seq)
            if seq.is_finished:
                done.append(self._finish(seq))
        if ghosts:
            self._release_ghosts(ghosts)
        return done

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
        seq = Sequence(request, self.proposer.name, k, self.num_speculative_tokens)
        if request.grammar is not None and request.replay is None:
            from specbatch.engine.grammar import new_matcher

            seq.matcher = new_matcher(request.grammar,
                                      self.stop_rules.grammar_stop_ids(request.sampling))
        return seq

    def _finish(self, seq: Sequence) -> Completion:
        self.proposer.finish(seq)
        self.runner.release(seq)
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
            text = hold_back_incomplete_char(text)
        c = Completion(seq.request, seq.token_ids[:seq.num_prompt_tokens], out, text,
                       seq.finish_reason, seq.stop_reason, seq.error, seq.stats,
                       seq.logprobs if seq.sampling.logprobs is not None else None,
                       prompt_fed=seq.is_prefilled,
                       schedule={"admit": seq.admit_step, "verify": seq.verify_step,
                                 "finish": self.step_index, "row": seq.row,
                                 "phase": self._phase})
        if self.follow_up is not None and seq.finish_reason != "error":
            nxt = self.follow_up(c)
            if nxt is not None:
                self.scheduler.add(nxt, front=True)
        return c


def hold_back_incomplete_char(text: str) -> str:
    """``text`` without the U+FFFD a detokenizer makes of an incomplete UTF-8 character at the
    end (``max_tokens`` cut inside it): up to 3, one per byte for byte-fallback tokenizers.

    Streaming detokenizers hold such a tail back until the character completes (vLLM's
    ``detokenize_incrementally``: text ending in U+FFFD is not emitted); at the end of an output
    it never completes. Like them, this cannot tell a genuine U+FFFD token at the very end
    from an incomplete character, and drops it too. ``output_token_ids`` keep every token.
    """
    stripped = text.rstrip("\ufffd")
    return text[:max(len(stripped), len(text) - 3)]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _rows_with_nan(logits: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
    """``[B]`` bool on the logits' device: whether row b's fed logits (``[T, V]``, row order)
    hold a NaN (``amax`` keeps one), without a host sync."""
    return meta.grid(torch.isnan(logits.amax(dim=-1)), False).any(dim=1)
