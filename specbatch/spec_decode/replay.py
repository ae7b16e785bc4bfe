"""What-if replay: the acceptance an n-gram configuration would have had on a recorded output.

At temperature 0 the target's token at every position is a function of the tokens before it,
and the n-gram proposer's drafts are a function of the committed tokens alone. Given the prompt
and the recorded output ids, the engine's step loop for *any* (k, prompt_lookup_min, max) can
therefore be replayed without the model, exactly as ``Engine`` runs it (one answer, one row):

    prefill: the first output token, no draft (one step, not in ``k_histogram``)
    each verify step, with n output tokens committed:
        cap    = draft_cap(k, max_tokens, n, max_model_len, len(prompt) + n)
        draft  = the proposer's draft at this length, cut to cap
        a      = length of the draft's prefix that equals the recorded output from n on
        commit a + 1 tokens (the accepted drafts plus the recovered / bonus token), fewer when
                 the recorded output ends first (the engine stopped there: EOS, stop id or
                 string, max_tokens or the context)
        record_step(len(draft), min(a, committed))   as ``Engine._commit_step`` counts it
                 (a stops at the recorded end, so min(a, committed) = a)

For the run's own configuration the replayed ``SpecStats`` equal the recorded ones (tested);
for another configuration they are what that run would have measured, since speculation does
not change the output.

Speed: ``NgramIndex.propose(k)`` returns the first k tokens of ``propose(k_max)`` (a draft is
built left to right and does not depend on k), so ``NgramReplay`` computes the k_max-token draft
once per output position and replays every k <= k_max from that table.
"""

from __future__ import annotations

from collections.abc import Iterator

from specbatch.spec_decode.caps import draft_cap
from specbatch.spec_decode.ngram import NgramIndex
from specbatch.spec_decode.stats import SpecStats


class NgramReplay:
    """Drafts of one (prompt_lookup_min, prompt_lookup_max) proposer over one recorded answer.

    prompt_ids: the prompt the engine saw (tokens). output_ids: the recorded completion,
    including a final EOS / stop id (``output_token_ids`` of one turn); at least one token.
    max_k: the largest k that ``stats`` will be asked for.
    """

    def __init__(self, prompt_ids: list[int], output_ids: list[int], prompt_lookup_min: int,
                 prompt_lookup_max: int, max_k: int) -> None:
        if not output_ids:
            raise ValueError("output_ids is empty: the engine emits at least one token")
        self.prompt_ids = list(prompt_ids)
        self.output_ids = list(output_ids)
        self.max_k = max_k
        tokens = self.prompt_ids + self.output_ids[:1]
        index = NgramIndex(tokens, prompt_lookup_min, prompt_lookup_max)
        # drafts[n]: the max_k-token draft with n output tokens committed (n >= 1)
        self.drafts: list[list[int]] = [[]]
        for n in range(1, len(self.output_ids)):
            self.drafts.append(index.propose(max_k))
            tokens.append(self.output_ids[n])
            index.extend()

    def steps(self, k: int, max_tokens: int, max_model_len: int, start: int = 1,
              end: int | None = None) -> Iterator[tuple[list[int], int, int]]:
        """Replayed verify steps at draft cap ``k`` as ``(draft, accepted, emitted)``.

        start: output tokens already committed when the replay begins (>= 1: prefill emits the
        first). end: stop once this many output tokens are committed (default: the whole
        answer). ``accepted`` counts the draft tokens equal to the recorded output (stopping at
        the recorded end); the step commits ``emitted = accepted + 1`` tokens, fewer on the last.
        """
        if not 0 <= k <= self.max_k:
            raise ValueError(f"k={k}: expected 0 <= k <= max_k={self.max_k}")
        out = self.output_ids
        end = len(out) if end is None else min(end, len(out))
        num_prompt = len(self.prompt_ids)
        n = max(start, 1)
        while n < end:
            cap = draft_cap(k, max_tokens, n, max_model_len, num_prompt + n)
            draft = self.drafts[n][:cap]
            # accepted stops at the recorded end: the engine stopped there and counted at most
            # the committed tokens, min(accepted, committed), which is this same number
            accepted = 0
            while (accepted < len(draft) and n + accepted < len(out)
                   and draft[accepted] == out[n + accepted]):
                accepted += 1
            yield draft, accepted, min(accepted + 1, len(out) - n)
            n += accepted + 1  # overshoots the end only on the last step

    def stats(self, k: int, max_tokens: int, max_model_len: int,
              proposer: str = "ngram", start: int = 1,
              steps_out: list[tuple[int, int]] | None = None) -> SpecStats:
        """Replayed ``SpecStats`` of this answer at draft cap ``k`` (<= ``max_k``).

        max_tokens: the record's completion cap (tokens). max_model_len: the run's context cap
        (tokens), as saved in ``OUT.config.json``. start: replay only the steps after this many
        output tokens (1 = the whole answer, counting its prefill step); with start > 1 the
        stats measure the rest of the answer, e.g. after a probe prefix. steps_out: given, gets
        each verify step's ``(draft tokens, emitted tokens)`` appended, in order.
        """
        stats = SpecStats(proposer=proposer, num_speculative_tokens=k)
        if start <= 1:
            stats.num_steps += 1  # prefill emits the first token
        for draft, accepted, emitted in self.steps(k, max_tokens, max_model_len, start):
            stats.record_step(len(draft), accepted)
            if steps_out is not None:
                steps_out.append((len(draft), emitted))
        return stats


def replay_ngram(prompt_ids: list[int], output_ids: list[int], k: int, prompt_lookup_min: int,
                 prompt_lookup_max: int, max_tokens: int, max_model_len: int) -> SpecStats:
    """Replayed ``SpecStats`` of one answer for one n-gram configuration (see the module doc)."""
    replay = NgramReplay(prompt_ids, output_ids, prompt_lookup_min, prompt_lookup_max, k)
    return replay.stats(k, max_tokens, max_model_len)
