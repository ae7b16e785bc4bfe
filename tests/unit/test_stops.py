"""Stop rules through the engine, with speculation on: a scripted target (``ScriptedForward``)
whose next token is ``succ(t) = t + 1`` (15 wraps to 1) makes every n-gram draft of the cycle
accepted, so stops land inside accepted runs, where dropping tokens is easy to get wrong.

Every case also runs with k = 0 and must give the same output, finish reason and text.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specbatch.config import SamplingParams
from specbatch.engine.kv_cache import KVCache
from specbatch.engine.runner import PAD_ID
from tests.helpers import repeating_prompts, run_engine, tiny_llama, total

VOCAB = 16


def succ(t: int) -> int:
    return t % (VOCAB - 1) + 1  # cycles over 1..15, never the pad id 0


class ScriptedForward:
    """Stands in for ``LlamaForward`` and its ``StepBackend``: the logits at a query depend
    only on the token fed there. ``succ(t)`` scores 10, ``succ(succ(t))`` 5 (the runner-up,
    taken when ``succ(t)`` is banned), the rest 0. Records the largest position a real
    (non-pad) token was fed at."""

    def __init__(self) -> None:
        assert PAD_ID == 0
        self.vocab_size = VOCAB
        self.device = torch.device("cpu")
        self.dtype = torch.float64
        self.table = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        for t in range(1, VOCAB):
            self.table[t, succ(t)] = 10.0
            self.table[t, succ(succ(t))] = 5.0
        self.max_real_position = -1
        self.num_calls = 0
        self.backend = self  # StepBackend
        self.name, self.kv_dtype = "scripted", self.dtype
        self.min_query_len, self.prefill_per_token, self.packed_attention = 2, False, False

    def new_cache(self, num_rows: int, capacity: int) -> KVCache:
        return KVCache(1, num_rows, 1, capacity, 1, self.dtype, self.device)

    def step(self, input_ids, positions, cache, rows, logits_index=None, num_fed=None):
        assert int(positions.max()) < cache.capacity
        real = input_ids != PAD_ID
        self.max_real_position = max(self.max_real_position, int(positions[real].max()))
        self.num_calls += 1
        logits = self.table[input_ids]  # [B, Q, V]
        if logits_index is not None:
            logits = torch.gather(logits, 1, logits_index[:, :, None].expand(-1, -1, VOCAB))
        return logits

    def prefill(self, input_ids, cache, chunks, logits_at):
        """Packed prompt chunks ``(row, start, length)`` (see ``StepBackend.prefill``)."""
        last = max(start + n - 1 for _, start, n in chunks)
        assert last < cache.capacity
        self.max_real_position = max(self.max_real_position, last)
        self.num_calls += 1
        return self.table[input_ids[logits_at]]  # [len(logits_at), V]


def detokenize(ids: list[int]) -> str:
    """Token t is two letters: 4 -> "Ee", 5 -> "Ff", so a stop string can span two tokens."""
    return "".join(chr(ord("A") + t) + chr(ord("a") + t) for t in ids)


PROMPT = list(range(1, VOCAB)) + [1, 2, 3]  # the whole cycle, then 1 2 3: output starts 4 5 6
CYCLE = [succ(t) for t in range(3, 3 + 20)]  # the greedy output: 4 5 ... 15 1 2 3 4 5 ...


@dataclass
class Case:
    name: str
    sampling: SamplingParams
    output: list[int]
    finish_reason: str
    stop_reason: int | str | None
    text: str
    num_steps: int  # with k = 5
    num_accepted: int  # committed accepted draft tokens, with k = 5
    eos_ids: tuple[int, ...] = ()
    k: int = 5


def sp(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 20, **kw})


CASES = [
    # drafts 5 6 7 8 9 all accepted; EOS 7 ends the run: 8, 9 and the bonus 10 are dropped
    Case("eos mid accepted run", sp(), [4, 5, 6, 7], "stop", 7, "EeFfGg", 2, 3, eos_ids=(7,)),
    Case("stop id mid run", sp(stop_token_ids=(6,), max_tokens=5), [4, 5, 6], "stop", 6,
         "EeFf", 2, 2),
    # the stop id is also the max_tokens-th token: the stop id wins
    Case("stop id at the length cap", sp(stop_token_ids=(8,), max_tokens=5),
         [4, 5, 6, 7, 8], "stop", 8, "EeFfGgHh", 2, 3),
    Case("length cap before stop id", sp(stop_token_ids=(9,), max_tokens=5),
         [4, 5, 6, 7, 8], "length", None, "EeFfGgHhIi", 2, 3),
    Case("later-listed stop string completes first", sp(stop=("Hh", "Ff")), [4, 5], "stop",
         "Ff", "Ee", 2, 1),
    # both complete at token 6 ("...FfGg"): "fG" ends one character earlier
    Case("two stop strings complete in one token", sp(stop=("Gg", "fG")), [4, 5, 6], "stop",
         "fG", "EeF", 2, 2),
    Case("stop string spans two tokens", sp(stop=("eF",)), [4, 5], "stop", "eF", "E", 2, 1),
    Case("stop string at the length cap", sp(stop=("Gg",), max_tokens=3), [4, 5, 6], "stop",
         "Gg", "EeFf", 2, 1),
    Case("stop string never completes", sp(stop=("Ee Ff", "aB"), max_tokens=4), [4, 5, 6, 7],
         "length", None, "EeFfGgHh", 2, 2),
    Case("max_tokens 1", sp(max_tokens=1), [4], "length", None, "Ee", 1, 0),
    Case("max_tokens 2", sp(max_tokens=2), [4, 5], "length", None, "EeFf", 2, 0),
    Case("max_tokens 3", sp(max_tokens=3), [4, 5, 6], "length", None, "EeFfGg", 2, 1),
    # steps: prefill 4 | drafts 5..9 + bonus 10 | drafts 11 12 + bonus 13 (capped by max_tokens)
    Case("ignore_eos runs to max_tokens", sp(ignore_eos=True, max_tokens=10),
         list(range(4, 14)), "length", None, detokenize(list(range(4, 14))), 3, 7,
         eos_ids=(7,)),
    # EOS 7 is banned at output position 3: the runner-up 8 comes instead (draft 7 rejected)
    Case("min_tokens bans EOS before it", sp(min_tokens=4, max_tokens=8),
         [4, 5, 6, 8, 9, 10, 11, 12], "length", None, detokenize([4, 5, 6, 8, 9, 10, 11, 12]),
         3, 5, eos_ids=(7,)),
    Case("min_tokens allows EOS at it", sp(min_tokens=3), [4, 5, 6, 7], "stop", 7, "EeFfGg",
         2, 3, eos_ids=(7,)),
    Case("min_tokens bans stop ids too", sp(min_tokens=4, max_tokens=5, stop_token_ids=(7,)),
         [4, 5, 6, 8, 9], "length", None, "EeFfGgIiJj", 3, 2),
    # stop strings, as vLLM's detokenizer: one that completes within the first min_tokens
    # tokens does not count, ever; the next occurrence (output tokens 16, 17: 4 5) does
    Case("min_tokens holds stop strings back", sp(min_tokens=3, stop=("Ff",)),
         CYCLE[:17], "stop", "Ff", detokenize(CYCLE[:16]), 4, 14),
    # "fG" completes with the 3rd token: allowed after 2, not after 3 (it ends inside them)
    Case("stop string completing after min_tokens", sp(min_tokens=2, stop=("fG",)), [4, 5, 6],
         "stop", "fG", "EeF", 2, 2),
    Case("stop string completing at min_tokens", sp(min_tokens=3, stop=("fG",)), CYCLE[:18],
         "stop", "fG", detokenize(CYCLE[:16]) + "F", 4, 15),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_stop_table(case: Case):
    results = {}
    for k in (case.k, 0):
        out = run_engine(ScriptedForward(), [PROMPT], k, 1, case.sampling, eos_ids=case.eos_ids,
                         detokenize=detokenize)[0]
        results[k] = out
        assert out.output_ids == case.output, k
        assert out.finish_reason == case.finish_reason, k
        assert out.stop_reason == case.stop_reason, k
        assert out.text == case.text, k
        assert out.error is None
    s = results[case.k].stats
    assert (s.num_steps, s.num_accepted_tokens) == (case.num_steps, case.num_accepted)
    # stats count committed tokens only: nothing past the stop is an accepted token
    assert s.num_accepted_tokens <= len(case.output) - 1
    assert sum(s.num_accepted_tokens_per_pos) == s.num_accepted_tokens
    plain = results[0].stats
    assert (plain.num_steps, plain.num_draft_tokens) == (len(case.output), 0)


def test_stats_drop_accepted_tokens_after_a_stop():
    """The verify step accepts all 5 drafts (5 6 7 8 9), but EOS 7 is the third: 3 accepted
    tokens are counted, 5 drafted."""
    out = run_engine(ScriptedForward(), [PROMPT], 5, 1, sp(), eos_ids=(7,))[0]
    s = out.stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (1, 5, 3)
    assert s.num_accepted_tokens_per_pos == [1, 1, 1, 0, 0]
    assert s.mean_acceptance_length == 4.0


MAX_MODEL_LEN = 20


def test_context_cap_stops_with_length_and_never_feeds_past_it():
    """Prompts 1, 3 and 6 tokens short of the context, decoded together (3 rows, k = 5, so
    drafts must be capped by the context): each fills the context exactly, and no real token
    is fed at a position >= max_model_len (the last token is never fed: max 18)."""
    prompts = [(PROMPT * 2)[:MAX_MODEL_LEN - gap] for gap in (1, 3, 6)]
    fwd = ScriptedForward()
    out = run_engine(fwd, prompts, 5, 3, sp(max_tokens=100), max_model_len=MAX_MODEL_LEN)
    for c, p, gap in zip(out, prompts, (1, 3, 6)):
        assert c.finish_reason == "length"
        assert len(c.output_ids) == gap
        assert c.output_ids == _cycle_from(succ(p[-1]), gap)
    assert fwd.max_real_position == MAX_MODEL_LEN - 2
    assert total(out, "num_accepted_tokens") > 0


def _cycle_from(t: int, n: int) -> list[int]:
    out = [t]
    while len(out) < n:
        out.append(succ(out[-1]))
    return out


def test_prompt_longer_than_context_is_an_error():
    """The long prompt fails alone, with a message naming both lengths; its neighbours run."""
    long_prompt = (PROMPT * 2)[:25]
    prompts = [PROMPT[:5], long_prompt, PROMPT[:10]]
    fwd = ScriptedForward()
    out = run_engine(fwd, prompts, 5, 2, sp(max_tokens=6), max_model_len=MAX_MODEL_LEN)
    bad = out[1]
    assert bad.finish_reason == "error"
    assert bad.output_ids == [] and bad.text == ""
    assert bad.error == "prompt is 25 tokens; the model's context is 20"
    assert [c.finish_reason for c in (out[0], out[2])] == ["length", "length"]
    assert out[0].output_ids == _cycle_from(6, 6) and out[2].output_ids == _cycle_from(11, 6)
    assert fwd.max_real_position < MAX_MODEL_LEN


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_with_spec_on_and_off(temperature):
    """float64 tiny Llama: the chosen token's logprob and the top 3 agree within 1e-9, and
    equal log_softmax(logits / T) of transformers' own forward."""
    model = tiny_llama(64, seed=9)
    prompts = repeating_prompts(64, 6, seed=10)
    sampling = SamplingParams(max_tokens=12, temperature=temperature, logprobs=3)
    plain = run_engine(model, prompts, 0, 1, sampling)
    spec = run_engine(model, prompts, 5, 4, sampling)
    if temperature == 0.0:
        assert total(spec, "num_accepted_tokens") > 0
    for a, b in zip(plain, spec):
        assert a.output_ids == b.output_ids
        assert len(a.logprobs) == len(b.logprobs) == len(a.output_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id
            assert abs(x.logprob - y.logprob) < 1e-9
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert max(abs(u - v) for (_, u), (_, v) in zip(x.top, y.top)) < 1e-9
    c = spec[0]
    with torch.no_grad():
        logits = model(torch.tensor([c.prompt_ids + c.output_ids])).logits[0]
    scale = temperature or 1.0
    ref = torch.log_softmax(logits[len(c.prompt_ids) - 1:-1] / scale, dim=-1)
    for j, entry in enumerate(c.logprobs):
        assert abs(entry.logprob - ref[j, entry.token_id].item()) < 1e-9
        top = torch.topk(ref[j], 3)
        assert [t for t, _ in entry.top] == top.indices.tolist()


# token -> UTF-8 bytes: 5 6 split "你" (e4 bd a0); 8 9 10 split "😀" (f0 9f 98 80)
BYTES = {4: b"a", 5: b"\xe4\xbd", 6: b"\xa0", 7: b"b", 8: b"\xf0", 9: b"\x9f\x98", 10: b"\x80"}


def byte_detokenize(ids: list[int]) -> str:
    """A byte-level detokenizer: bytes joined, then decoded with U+FFFD for bad bytes."""
    return b"".join(BYTES.get(t, b"?") for t in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("max_tokens, text", [(1, "a"), (2, "a"), (3, "a你"), (4, "a你b"),
                                              (5, "a你b"), (6, "a你b"), (7, "a你b😀")])
def test_text_holds_back_an_incomplete_character(max_tokens, text):
    """max_tokens cutting inside a multi-byte character: the text leaves the incomplete
    character out (no U+FFFD), as a streaming detokenizer holds it back; the ids stay whole."""
    for k in (5, 0):
        out = run_engine(ScriptedForward(), [PROMPT], k, 1, sp(max_tokens=max_tokens),
                         detokenize=byte_detokenize)[0]
        assert out.output_ids == CYCLE[:max_tokens] and out.finish_reason == "length"
        assert out.text == text, k


def test_stop_strings_search_only_the_new_end_of_the_text():
    """With many stop strings the search per committed token covers the text added since the
    last search (plus ``STOP_TEXT_MARGIN`` characters a detokenizer may rewrite), not the whole
    output: 1,000 stop strings over a 512-token output cost 1.3 ms a token before (issue 36).
    The earliest-ending stop string still wins, including one that straddles two tokens."""
    from specbatch.engine.sequence import STOP_TEXT_MARGIN, Request, Sequence, StopRules

    starts: list[int] = []

    class Text(str):
        def find(self, sub, start=0, *args):
            starts.append(start)
            return str.find(self, sub, start, *args)

    words = {i: f"w{i:03d} " for i in range(600)}
    rules = StopRules(frozenset(), 1 << 20, lambda ids: Text("".join(words[i] for i in ids)))
    stops = tuple(f"zz{i:04d}" for i in range(1000)) + ("w098 w0",)
    seq = Sequence(Request("r", [1], SamplingParams(max_tokens=500, stop=stops)), "none", 0)
    for tok in range(100):
        starts.clear()
        rules.commit(seq, [tok])
        if seq.finish_reason:
            break
        # text before this token: 5 chars a token; nothing before it less the margin is read
        assert min(starts) >= max(0, 5 * tok - STOP_TEXT_MARGIN - len("w098 w0") + 1), tok
    assert seq.finish_reason == "stop" and seq.stop_reason == "w098 w0"
    assert seq.num_output_tokens == 100 and seq.stop_text_end == 5 * 98
