"""Prompt-lookup (n-gram) proposer.

Follows prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding) and
vLLM's ``ngram`` method: find the longest suffix of the record's tokens (prompt + output so far),
between ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens long, that occurred earlier in the
same record, and propose the k tokens that followed it.

Tie rule: among earlier occurrences of the same n-gram, the **most recent** one wins.
When the continuation runs into the end of the sequence, drafting continues with the proposed
tokens themselves (periodic text like ``a b a b`` then drafts ``a b a b ...``).

The index is a dict per n-gram size mapping the n-gram to the position right after its latest
occurrence; it is updated as tokens are committed, O(max - min + 1) per token, never rescanned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specbatch.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from specbatch.engine.sequence import Sequence


class NgramIndex:
    """Lookup index over one token sequence.

    ``tokens`` is the caller's list, read not copied; call ``extend()`` after appending.
    """

    def __init__(self, tokens: list[int], min_n: int, max_n: int) -> None:
        self.tokens = tokens
        self.min_n = min_n
        self.max_n = max_n
        # size n -> {n-gram: index of the token that followed its latest occurrence}
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.num_indexed = 0
        self.match_len = 0  # n-gram size (tokens) behind the last proposal; 0: none matched
        self.extend()

    def extend(self) -> None:
        """Index the n-grams that ended before each newly appended token."""
        toks = self.tokens
        for i in range(max(self.num_indexed, 1), len(toks)):
            # token i follows the n-grams toks[i-n:i]
            for n, table in self.tables.items():
                if i >= n:
                    table[tuple(toks[i - n:i])] = i
        self.num_indexed = len(toks)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft ids continuing the longest matched suffix; [] when none matches."""
        toks = self.tokens
        length = len(toks)
        self.match_len = 0
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self.tables[n].get(tuple(toks[length - n:]))
            if start is None:
                continue
            self.match_len = n
            draft: list[int] = []
            for j in range(start, start + k):
                draft.append(toks[j] if j < length else draft[j - length])
            return draft
        return []


class NgramProposer(Proposer):
    """``--method ngram``. State per sequence: one ``NgramIndex`` over ``seq.token_ids``."""

    name = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({prompt_lookup_max})")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.indexes: dict[int, NgramIndex] = {}

    def start(self, seq: Sequence) -> None:
        self.indexes[seq.seq_id] = NgramIndex(seq.token_ids, self.min_n, self.max_n)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self.indexes[s.seq_id].propose(k) for s, k in zip(seqs, ks)]

    def match_len(self, seq: Sequence) -> int:
        """Size (tokens) of the n-gram behind the row's last proposal; 0 if none matched. A
        longer match is accepted more often (``auto.candidate.LookupCandidate`` uses it)."""
        return self.indexes[seq.seq_id].match_len

    def on_commit(self, seq: Sequence, num_new_tokens: int) -> None:
        self.indexes[seq.seq_id].extend()

    def finish(self, seq: Sequence) -> None:
        self.indexes.pop(seq.seq_id, None)
