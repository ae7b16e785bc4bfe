"""Suffix proposer (``--method suffix``): drafts from the record's own text and from the outputs
of the records already finished in this job.

Follows SuffixDecoding (Oliaro, Jia, Campos, Qiao; "SuffixDecoding: Extreme Speculative
Decoding for Emerging AI Applications", arXiv 2411.04975; in vLLM as ``method="suffix"``, from
Snowflake's Arctic Inference): a per-request index over the prompt and output so far and a
global index over previous responses; the current suffix is matched in both, candidate
continuations are scored by frequency, and the better-scoring source drafts. Differences from
the paper: the indexes here are suffix automata (below), not suffix trees; the draft is one
path (the verifier checks a linear draft), not a speculation tree; and the source is chosen by
match length (below).

Scoring, as in the paper. From the state of the longest matched suffix P (``match_len`` tokens),
the draft is grown greedily: the next token is the continuation c of P with the most
occurrences, its probability ``occ(P c) / occ(P)`` (an occurrence of P at the end of a document
has no continuation and counts against every c), and the path probability is the product along
the draft. Growth stops when the path probability drops below ``min_token_prob`` (0.1), at
``max_spec_factor * match_len`` tokens (1.0: a long match earns a long draft; a 2-token match at
most 2 drafts) and at the cap (the engine's per-row cap, see ``SpecConfig.draft_cap``, which for
suffix is larger than k: long, frequent matches draft past k). Ties between continuations of
equal count go to the lowest token id. ``auto`` calibrates the path probabilities against the
acceptance it measures (``auto.candidate.SuffixCandidate``).

Two choices of ours, both measured by replaying recorded greedy outputs without the
model (acceptance is exact at temperature 0; docs/benchmarks.md, issue 14):
- the own-text draft and the job-wide draft compete on **match length**, not on score (ties: own
  text). The two automata's frequencies are not comparable: a row's own text holds one copy of
  most strings, so its paths read probability 1.0, while the job index spreads counts over
  hundreds of answers. The longer match is the better predictor: on the templated extraction
  job (100 records, JSON schema) it commits 2.67 tokens per verify step against 2.58 when the
  higher sum of path probabilities (the paper's score) chooses.
- in a verify step of at most ``FEW_ROWS`` rows the own-text draft may grow to
  ``OWN_FACTOR_FEW_ROWS`` (2) times its match length: such a step is bound by reading the
  weights, so a longer draft costs little (batch 1: one fed token ~5-14% of a step), while in a
  full batch-16 step each fed token costs about a quarter to a half of a row's share. Drafts
  thus depend on the rows in the step as well; outputs never do.
- ``--method suffix`` (not ``auto``'s suffix drafts, which auto cuts by its measured step cost)
  cuts drafts in steps of more than ``FEW_ROWS`` rows at path probability
  ``MANY_ROWS_MIN_TOKEN_PROB`` (0.7) and at k tokens (``many_rows_cap``): SuffixDecoding's 0.1
  and 3k fit a GPU, where a step of 16 rows is still bound by reading the weights, not a CPU,
  where it is compute-bound. Replayed at batch 16 with a fed token at 0.5 of a row's share
  (int8 on an AMX Xeon; docs/benchmarks.md, session 11): on the 130-record Spec-Bench subset
  output per unit of step cost rises from 0.868 to 0.973 (ngram k3 0.997), on the templated
  extraction job from 1.045 to 1.178 (ngram k3 1.053). At batch 1 the same cut gains nothing
  (1.873 vs 1.867 at 0.14 of a step per fed token), so few-row steps keep the paper's.

Why a suffix automaton. It is the smallest structure that answers "longest suffix of the row's
text that occurs in the index" and "how often is each continuation seen" exactly, and it is
built online in amortised O(1) per token (Blumer et al. 1985; the generalized form resets to the
root at each document). The longest match of a row's last ``max_match`` tokens is found by
walking them from the root with suffix links (O(max_match) dict lookups), so a propose call costs
the same with 10 or 10,000 records indexed. Occurrence counts are kept online: appending a
token adds one to every state on the new state's suffix-link path (the suffixes ending there),
a path no longer than the document's length so far. A suffix array would answer counts as
range sizes, but it cannot be extended a record at a time without rebuilding, and each lookup is
a binary search of Python-level comparisons; a depth-bounded suffix trie (the paper's tree with
``max_depth`` 24, without path compression) needs 14.4 nodes per token on the extraction job's
outputs against the automaton's 1.07 states (``benchmarks/suffix_lookup.py``; docs/benchmarks.md).

Memory bound and eviction. The job-wide index holds at most ``max_tokens`` output tokens. When
a finished record would pass it, the oldest documents are dropped (oldest first, until the rest
fits in 3/4 of the bound with the new one) and the automaton is rebuilt from the documents left:
automata cannot delete, and a rebuild costs ~40 us per token kept (measured at load 20 on the
2-core machine), once per ~1/4 bound of new tokens. A document longer than the bound is not
indexed.

Determinism. Drafts are a function of the row's committed tokens and of the index, that is of
which answers finished before, in which order; outputs never depend on them (the verifier
decides), but a record's acceptance stats depend on job order (docs/output.md). A resumed job
replays the interrupted run's schedule (``Request.replay``): finished answers join the index at
the step they finished and count in the rows of the steps they were in (``propose(num_rows=)``),
so the records run after the resume draft as in an uninterrupted run.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specbatch.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from specbatch.engine.sequence import Sequence

MIN_TOKEN_PROB = 0.1  # SuffixDecoding's default min_token_prob
MAX_SPEC_FACTOR = 1.0  # draft length <= factor * match length (SuffixDecoding max_spec_factor)
OWN_FACTOR_FEW_ROWS = 2.0  # the own-text draft's factor in steps of <= FEW_ROWS rows
FEW_ROWS = 2
MANY_ROWS_MIN_TOKEN_PROB = 0.7  # --method suffix, steps of more than FEW_ROWS rows
MAX_MATCH = 32  # tokens of the row's tail matched against the job-wide index
DEFAULT_MAX_TOKENS = 1 << 20  # job-wide index bound (output tokens), ~1M


class SuffixAutomaton:
    """Generalized suffix automaton over token-id documents, with occurrence counts.

    State 0 is the root (the empty string). For state v: ``length[v]`` is its longest string's
    length (tokens), ``link[v]`` its suffix link, ``nxt[v]`` its transitions (token id -> state),
    ``occ[v]`` the number of (document, end position) pairs where its strings end.

    ``best[v]``, kept for the states a draft has passed through, is v's most frequent
    continuation ``(token, child)``: a propose call follows the same few hot paths step after
    step, and after a model step has pushed the index out of the CPU caches, scanning a state's
    children for the largest count (~18 near the root, three cache misses each) was ~80% of a
    propose call's time. The cache is kept up to date, not dropped, as documents arrive (a
    finished record's answer walks the same hot paths, and dropping them cost the next propose
    call a rescan of every one, ~1.6 ms for 16 rows): ``watch[c]`` maps each state u with a
    cached best that has c as a child to the token of that transition. Counts only grow, so when
    c's count grows, c replaces u's best if it now has the larger count (or the same count and
    a lower token id); a new transition of u is watched from its creation, and a clone that
    takes over u's transition to its best child takes over the best. An entry left behind when
    u's transition moved from q to a clone never fires: q's suffix link is then the clone, so
    every count q gains the clone gains too, and q never beats u's best. So a cached best always
    equals the scan (``tests/unit/test_suffix.py`` checks every entry as documents arrive).
    """

    def __init__(self) -> None:
        self.nxt: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.occ: list[int] = [0]
        self.num_tokens = 0
        self.best: dict[int, tuple[int, int]] = {}
        self.watch: dict[int, dict[int, int]] = {}

    @property
    def num_states(self) -> int:
        return len(self.length)

    def add_document(self, ids: Iterable[int]) -> None:
        """Index one document (a list of token ids) as a separate string."""
        last = 0
        for tok in ids:
            last = self.extend(last, tok)

    def extend(self, last: int, tok: int) -> int:
        """Append ``tok`` to the document whose whole text so far is state ``last`` (0 for a
        new document); returns the state of the extended text. Amortised O(1) plus the count
        update along the suffix-link path."""
        nxt, link, length, occ = self.nxt, self.link, self.length, self.occ
        best = self.best
        self.num_tokens += 1
        q = nxt[last].get(tok)
        if q is not None:  # the extended text already occurs (another document has it)
            if length[last] + 1 == length[q]:
                cur = q
            else:
                cur = self._clone(last, q, tok)
        else:
            cur = len(length)
            nxt.append({})
            link.append(0)
            length.append(length[last] + 1)
            occ.append(0)
            p = last
            watch = self.watch
            while p != -1 and tok not in nxt[p]:
                nxt[p][tok] = cur
                if p in best:  # a new child (count 0 now): compared as its count grows
                    watch.setdefault(cur, {})[p] = tok
                p = link[p]
            if p != -1:
                q = nxt[p][tok]
                link[cur] = q if length[p] + 1 == length[q] else self._clone(p, q, tok)
        v = cur  # the suffixes of the text ending here each gain this end position
        watch = self.watch
        while v > 0:
            occ[v] += 1
            parents = watch.get(v)
            if parents:
                n = occ[v]
                for u, t in parents.items():
                    bt, bw = best[u]
                    if bw != v and (n > occ[bw] or n == occ[bw] and t < bt):
                        best[u] = (t, v)
            v = link[v]
        return cur

    def _clone(self, p: int, q: int, tok: int) -> int:
        nxt, link, length = self.nxt, self.link, self.length
        clone = len(length)
        nxt.append(dict(nxt[q]))
        link.append(link[q])
        length.append(length[p] + 1)
        self.occ.append(self.occ[q])
        best, watch = self.best, self.watch
        while p != -1 and nxt[p].get(tok) == q:
            nxt[p][tok] = clone
            if p in best:  # the clone has q's count: it takes over q's place in p's best
                watch.setdefault(clone, {})[p] = tok
                if best[p][1] == q:
                    best[p] = (tok, clone)
            p = link[p]
        link[q] = clone
        return clone

    def match(self, tail: list[int], state: int = 0, n: int = 0,
              max_len: int | None = None) -> tuple[int, int]:
        """(state, length) of the longest suffix of ``tail`` that occurs in the index (root, 0
        when none), at most ``max_len`` tokens. O(len(tail)) amortised. Continues from
        ``(state, n)``, an earlier call's answer for the text before ``tail`` (with the same
        ``max_len``, and no document added since), so a row's match advances by its new
        tokens only. The answer equals a walk of the text's last ``max_len`` tokens from the
        root: an occurring suffix of the text plus one token, cut to ``max_len``, is an
        occurring suffix of at most ``max_len`` tokens of the text plus that token."""
        nxt, link, length = self.nxt, self.link, self.length
        v = state
        for tok in tail:
            while v and tok not in nxt[v]:
                v = link[v]
                n = length[v]
            w = nxt[v].get(tok)
            if w is None:
                v, n = 0, 0
            else:
                v, n = w, n + 1
                if max_len is not None and n > max_len:  # the state of the max_len suffix
                    n = max_len
                    while length[link[v]] >= n:
                        v = link[v]
        return v, n

    def continuation(self, state: int, max_len: int, min_prob: float = MIN_TOKEN_PROB,
                     open_end: bool = False) -> tuple[list[int], list[float], list[int]]:
        """Greedy most-frequent continuation from ``state``: up to ``max_len`` ids, each one's
        path probability (product of ``occ(child) / occ(parent)``) and each one's support (the
        ``occ(parent)`` of its step: the occurrences of its context that the frequency counts),
        stopping below ``min_prob``. Ties go to the lowest token id. open_end: ``state`` ends
        at the end of a document still being written (a row's own text), an occurrence whose
        continuation is what is being predicted, so it is left out of the first step's
        denominator."""
        nxt, occ, best = self.nxt, self.occ, self.best
        ids: list[int] = []
        probs: list[float] = []
        support: list[int] = []
        prob, v = 1.0, state
        while len(ids) < max_len and nxt[v] and occ[v]:
            tw = best.get(v)
            if tw is None:
                tw = best[v] = min(nxt[v].items(), key=lambda kv: (-occ[kv[1]], kv[0]))
                for t, c in nxt[v].items():
                    self.watch.setdefault(c, {})[v] = t
            tok, w = tw
            seen = occ[v] - 1 if open_end and not ids else occ[v]
            prob *= occ[w] / seen
            if prob < min_prob:
                break
            ids.append(tok)
            probs.append(prob)
            support.append(seen)
            v = w
        return ids, probs, support

    def nbytes(self) -> int:
        """Approximate Python heap bytes held (dicts, list slots, int objects, the caches)."""
        dicts = sum(sys.getsizeof(d) for d in self.nxt)
        caches = (sys.getsizeof(self.best) + 64 * len(self.best) + sys.getsizeof(self.watch)
                  + sum(sys.getsizeof(w) for w in self.watch.values()))
        return dicts + 4 * 8 * self.num_states + 32 * sum(len(d) for d in self.nxt) + caches


class SuffixIndex:
    """The job-wide index: a ``SuffixAutomaton`` over finished outputs, at most ``max_tokens``
    tokens, oldest documents evicted first (see the module docstring)."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: expected an integer >= 1")
        self.max_tokens = max_tokens
        self.version = 0  # + 1 per indexed document: a match state of an older version is stale
        self.docs: deque[tuple[int, ...]] = deque()
        self.num_tokens = 0
        self.num_evicted = 0  # documents dropped so far
        self.sam = SuffixAutomaton()

    def add(self, ids: Iterable[int]) -> None:
        """Index one finished answer's output ids (a document longer than the bound and an empty
        one are skipped)."""
        doc = tuple(ids)
        if not doc or len(doc) > self.max_tokens:
            return
        if self.num_tokens + len(doc) > self.max_tokens:
            keep = (3 * self.max_tokens) // 4 - len(doc)
            while self.docs and self.num_tokens > keep:
                self.num_tokens -= len(self.docs.popleft())
                self.num_evicted += 1
            self.sam = SuffixAutomaton()
            for d in self.docs:
                self.sam.add_document(d)
        self.docs.append(doc)
        self.num_tokens += len(doc)
        self.sam.add_document(doc)
        self.version += 1


@dataclass
class Draft:
    """One row's proposal: ids, each position's path probability, the matched suffix length
    (tokens), its source (``"self"``: the row's own text, ``"job"``: the job-wide index) and
    each position's support (the occurrences of its context behind its conditional frequency,
    ``SuffixAutomaton.continuation``: 1 where the text was seen once before)."""

    ids: list[int]
    probs: list[float]
    match_len: int
    source: str
    support: list[int]


_EMPTY = Draft([], [], 0, "", [])


def draft_from(sam: SuffixAutomaton, state: int, match_len: int, cap: int, source: str,
               min_prob: float = MIN_TOKEN_PROB, factor: float = MAX_SPEC_FACTOR) -> Draft:
    """The scored continuation of a match of ``match_len`` tokens at ``state`` (``source``
    ``"self"``: the row's own automaton, whose current end is an open occurrence)."""
    if match_len == 0 or cap <= 0:
        return _EMPTY
    max_len = min(cap, max(1, int(factor * match_len)))
    ids, probs, support = sam.continuation(state, max_len, min_prob, open_end=source == "self")
    return Draft(ids, probs, match_len, source, support)


class _Row:
    """The row's own text as one growing document of its own automaton."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.sam = SuffixAutomaton()
        self.last = 0
        self.num_indexed = 0
        self.extend()
        self.job = (-1, 0, 0, 0)  # (index version, tokens walked, state, length): job match

    def job_match(self, index: SuffixIndex, max_match: int) -> tuple[int, int]:
        """(state, length) of the longest suffix of the row's text, at most ``max_match``
        tokens, in the job-wide index: advanced by the tokens committed since the last call
        while no document joined the index (a join can clone states: walk again then)."""
        toks = self.seq.token_ids
        version, walked, state, n = self.job
        if version == index.version:
            state, n = index.sam.match(toks[walked:], state, n, max_match)
        else:
            state, n = index.sam.match(toks[-max_match:], max_len=max_match)
        self.job = (index.version, len(toks), state, n)
        return state, n

    def extend(self) -> None:
        toks = self.seq.token_ids
        for i in range(self.num_indexed, len(toks)):
            self.last = self.sam.extend(self.last, toks[i])
        self.num_indexed = len(toks)

    def match(self) -> int:
        """The state of the longest suffix of the row's text that also occurs earlier with a
        continuation: the first state on the suffix-link path of the whole text that has
        transitions (its ``sam.length`` is the match length)."""
        sam, v = self.sam, self.last
        while v and not sam.nxt[v]:
            v = sam.link[v]
        return v

    def draft(self, cap: int, min_prob: float, factor: float) -> Draft:
        """The continuation of ``match``."""
        v = self.match()
        return draft_from(self.sam, v, self.sam.length[v], cap, "self", min_prob, factor)


class SuffixProposer(Proposer):
    """``--method suffix``. index: the job-wide ``SuffixIndex`` (shared by the job's rows; a
    fresh one per engine). Finished answers (not ``error`` ones) join it at ``finish``.
    many_rows_cap: in steps of more than ``FEW_ROWS`` rows, drafts stop at this many tokens
    and at path probability ``many_rows_min_prob`` (the module docstring); None: no such cut
    (``auto``'s suffix drafts, which the policy cuts)."""

    name = "suffix"

    def __init__(self, index: SuffixIndex | None = None, min_token_prob: float = MIN_TOKEN_PROB,
                 max_spec_factor: float = MAX_SPEC_FACTOR, max_match: int = MAX_MATCH,
                 many_rows_cap: int | None = None,
                 many_rows_min_prob: float = MANY_ROWS_MIN_TOKEN_PROB) -> None:
        self.index = index if index is not None else SuffixIndex()
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor
        self.max_match = max_match
        self.many_rows_cap = many_rows_cap
        self.many_rows_min_prob = many_rows_min_prob
        self.rows: dict[int, _Row] = {}
        self.last: dict[int, Draft] = {}  # seq id -> its latest draft

    def start(self, seq: Sequence) -> None:
        self.rows[seq.seq_id] = _Row(seq)

    def draft(self, seq: Sequence, cap: int, num_rows: int = 1) -> Draft:
        """The draft of the longer match, own text or job-wide (ties and both empty: own
        text), at most ``cap`` tokens. num_rows: rows in the verify step (the own-text factor
        and, with ``many_rows_cap``, the many-row cut; see the module docstring)."""
        factor, min_prob = self.max_spec_factor, self.min_token_prob
        if num_rows <= FEW_ROWS:
            own_factor = max(factor, OWN_FACTOR_FEW_ROWS)
        else:
            own_factor = factor
            if self.many_rows_cap is not None:
                cap, min_prob = min(cap, self.many_rows_cap), self.many_rows_min_prob
        if cap <= 0:
            return _EMPTY
        row = self.rows[seq.seq_id]
        if not self.index.sam.num_tokens:
            return row.draft(cap, min_prob, own_factor)
        v = row.match()
        mine = row.sam.length[v]
        state, n = row.job_match(self.index, self.max_match)
        # the longer match drafts; the other's continuation is walked only where the longer
        # one's is empty (a walk per row and step is most of a suffix lookup's time)
        if n > mine:
            job = draft_from(self.index.sam, state, n, cap, "job", min_prob, factor)
            if job.ids:
                return job
            return draft_from(row.sam, v, mine, cap, "self", min_prob, own_factor)
        own = draft_from(row.sam, v, mine, cap, "self", min_prob, own_factor)
        if own.ids or not n:
            return own
        job = draft_from(self.index.sam, state, n, cap, "job", min_prob, factor)
        return job if job.ids else own

    counts_rows = True  # drafts depend on the rows of the step: ``propose(num_rows=)``

    def propose(self, seqs: list[Sequence], ks: list[int],
                num_rows: int | None = None) -> list[list[int]]:
        """num_rows: the rows of the verify step (default ``len(seqs)``; a resumed job's
        placeholders count, ``engine.Engine``)."""
        num_rows = len(seqs) if num_rows is None else num_rows
        out = []
        for s, k in zip(seqs, ks):
            d = self.last[s.seq_id] = self.draft(s, k, num_rows)
            out.append(d.ids)
        return out

    def last_draft(self, seq: Sequence) -> Draft:
        """The row's latest ``Draft`` (probabilities, match length, source)."""
        return self.last.get(seq.seq_id, _EMPTY)

    def match_len(self, seq: Sequence) -> int:
        return self.last_draft(seq).match_len

    def on_commit(self, seq: Sequence, num_new_tokens: int) -> None:
        self.rows[seq.seq_id].extend()

    def finish(self, seq: Sequence) -> None:
        self.rows.pop(seq.seq_id, None)
        self.last.pop(seq.seq_id, None)
        if seq.finish_reason != "error":
            self.index.add(seq.output_ids)

    def add_finished(self, outputs: Iterable[list[int]]) -> None:
        """Resume: index the output ids of answers finished in an earlier run, in the order
        they finished (the work file's order)."""
        for ids in outputs:
            self.index.add(ids)


def finished_outputs(records: Iterable[dict]) -> list[list[int]]:
    """Output ids of finished output records (``turns`` records: one list per turn), in order,
    leaving out answers that stopped with an ``error``: the documents ``SuffixProposer.finish``
    would have indexed, for ``add_finished`` on resume."""
    out = []
    for r in records:
        ids, reasons = r.get("output_token_ids") or [], r.get("finish_reason")
        if not (ids and isinstance(ids[0], list)):
            ids, reasons = [ids], [reasons]
        out.extend(list(t) for t, why in zip(ids, reasons) if why != "error")
    return out
