"""Structured output (engine.grammar, engine.logits): on a tiny float64 model with a character
vocabulary, every output under a JSON schema parses and validates, n-gram k = 5 at batch 8 gives
exactly the tokens of plain decoding at batch 1, and the matcher ends each step at the committed
length."""

from __future__ import annotations

import json

import jsonschema
import pytest

xgr = pytest.importorskip("xgrammar")

from specbatch.config import SamplingParams  # noqa: E402
from specbatch.engine import logits as logits_processing  # noqa: E402
from specbatch.engine.grammar import GrammarCompiler, check_schema  # noqa: E402
from specbatch.engine.sequence import Request  # noqa: E402
from tests.helpers import make_engine, tiny_llama, total  # noqa: E402

VOCAB = [chr(c) for c in range(32, 127)] + ["</s>"]  # 96 tokens: printable ASCII, then EOS
EOS = len(VOCAB) - 1
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "ok": {"type": "boolean"},
                         "kind": {"enum": ["aa", "bb", "cc"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "ok", "kind", "n"], "additionalProperties": False}
EXAMPLE = '{"name": "abc", "ok": true, "kind": "aa", "n": 12} '


def encode(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def detokenize(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids if i != EOS)


@pytest.fixture(scope="module")
def setup():
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
    compiler = GrammarCompiler(info, len(VOCAB))
    model = tiny_llama(len(VOCAB), seed=5)
    # prompts that hold examples of the JSON, so n-gram drafts find matches
    prompts = [encode(EXAMPLE * (1 + i % 3) + "x" * (i % 4)) for i in range(12)]
    return model, compiler, prompts


def generate(model, compiler, prompts, k, batch_size, temperature, schema=SCHEMA,
             response_format=None, **sampling):
    rf = response_format or {"type": "json_schema", "json_schema": {"schema": schema}}
    sp = SamplingParams(**{"max_tokens": 80, "temperature": temperature, "response_format": rf,
                           **sampling})
    grammar = compiler.compile(sp.json_schema)
    engine = make_engine(model, k, batch_size, eos_ids=(EOS,), detokenize=detokenize)
    requests = [Request(i, p, sp, seed=i, grammar=grammar) for i, p in enumerate(prompts)]
    return sorted(engine.generate(requests), key=lambda c: c.request.request_id)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_outputs_validate_and_spec_equals_plain(setup, temperature):
    model, compiler, prompts = setup
    base = generate(model, compiler, prompts, 0, 1, temperature)
    out = generate(model, compiler, prompts, 5, 8, temperature)
    assert [c.output_ids for c in out] == [c.output_ids for c in base]
    for c in base:
        assert c.finish_reason == "stop" and c.stop_reason == EOS
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert total(out, "num_accepted_tokens") > 100  # drafts were accepted ...
    assert total(out, "num_draft_tokens") > total(out, "num_accepted_tokens")  # ... and refused


def test_json_object_gives_json_objects(setup):
    model, compiler, prompts = setup
    base = generate(model, compiler, prompts[:4], 0, 1, 0.8,
                    response_format={"type": "json_object"})
    out = generate(model, compiler, prompts[:4], 5, 4, 0.8,
                   response_format={"type": "json_object"})
    assert [c.output_ids for c in out] == [c.output_ids for c in base]
    for c in base:
        if c.finish_reason == "stop":  # json_object has no size bound: some hit max_tokens
            assert isinstance(json.loads(c.text), dict)
        assert c.text.startswith("{")


def test_masks_follow_the_drafts_before_each_position(setup, monkeypatch):
    """Masking every position with the committed state's mask (the matcher not advanced through
    the drafts before it) changes the output: the equality test above would catch it."""
    model, compiler, prompts = setup
    base = generate(model, compiler, prompts, 0, 1, 0.0)
    orig = logits_processing.grammar_masks

    def stale(seq, drafts, vocab):
        first = orig(seq, [], vocab)  # [1, W] packed
        return first.expand(len(drafts) + 1, first.shape[1]).clone()

    monkeypatch.setattr(logits_processing, "grammar_masks", stale)
    out = generate(model, compiler, prompts, 5, 8, 0.0)
    assert [c.output_ids for c in out] != [c.output_ids for c in base]


def test_matcher_is_at_the_committed_length_after_each_step(setup):
    """After every step the matcher accepts exactly what a fresh matcher fed the committed
    output accepts next."""
    model, compiler, prompts = setup
    sp = SamplingParams(max_tokens=80, response_format={"type": "json_schema",
                                                         "json_schema": {"schema": SCHEMA}})
    grammar = compiler.compile(SCHEMA)
    engine = make_engine(model, 5, 4, eos_ids=(EOS,), detokenize=detokenize)
    for i, p in enumerate(prompts[:4]):
        engine.scheduler.add(Request(i, p, sp, seed=i, grammar=grammar))
    from specbatch.engine.grammar import allowed_tokens, new_matcher

    checked = 0
    while engine.scheduler.has_work:
        engine.step()
        for seq in engine.scheduler.running_sequences():
            fresh = new_matcher(grammar, frozenset({EOS}))
            for tok in seq.output_ids:
                assert fresh.accept_token(tok)
            assert allowed_tokens(seq.matcher, len(VOCAB)).equal(
                allowed_tokens(fresh, len(VOCAB)))
            checked += 1
    assert checked > 20


def test_bad_schema_is_a_value_error():
    with pytest.raises(ValueError, match="does not compile"):
        check_schema({"type": "objectx"})
    with pytest.raises(ValueError, match="properties must be an object"):
        check_schema({"type": "object", "properties": 5})
    check_schema(SCHEMA)
    check_schema(True)


def test_packed_bitmask_helpers_agree_with_xgrammar():
    """``apply_bitmask`` through xgrammar's kernel (float32) writes exactly the ``-inf`` entries
    of the unpacked path (float64), and ``packed_tokens`` sets exactly the given ids' bits,
    bit 31 (the int32 sign bit) included."""
    import torch

    from specbatch.engine.grammar import packed_tokens, unpack_bitmask
    from specbatch.engine.logits import apply_bitmask

    vocab = 100  # not a multiple of 32: the last word is partly padding
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen, dtype=torch.float64)
    ref, fast = logits.clone(), logits.float()
    apply_bitmask(ref, bitmask)
    apply_bitmask(fast, bitmask)
    allowed = unpack_bitmask(bitmask, vocab)
    assert torch.equal(torch.isinf(ref), ~allowed) and torch.equal(torch.isinf(fast), ~allowed)
    assert torch.equal(fast[allowed], logits.float()[allowed])
    ids = [0, 31, 32, 63, 99]
    assert unpack_bitmask(packed_tokens(ids + [100, -1], vocab)[None], vocab)[0].nonzero() \
        .flatten().tolist() == ids


def test_valid_draft_prefix_cuts_at_the_first_refused_token(setup):
    """Hand-built drafts against a matcher at ``{"name": "ab``: the cut is exactly before the
    first token the grammar refuses (a stop id counts once the JSON is complete, and ends the
    draft), and the matcher is left where it was."""
    _, compiler, _ = setup
    from specbatch.engine.grammar import allowed_tokens, new_matcher

    class Row:
        matcher = new_matcher(compiler.compile(SCHEMA), frozenset({EOS}))

    seq = Row()
    for tok in encode('{"name": "ab'):
        assert seq.matcher.accept_token(tok)
    before = allowed_tokens(seq.matcher, len(VOCAB))
    cut = logits_processing.valid_draft_prefix
    assert cut(seq, encode('c", "ok": true')) == len('c", "ok": true')
    assert cut(seq, encode('c", "ok": x, "kind"')) == len('c", "ok": ')
    assert cut(seq, encode('c"}')) == 2  # all four keys are required
    assert cut(seq, encode("abcdefgh")) == len("abcdef")  # name: maxLength 8
    assert cut(seq, []) == 0
    assert allowed_tokens(seq.matcher, len(VOCAB)).equal(before)
    rest = encode('c", "ok": true, "kind": "aa", "n": 7}')
    assert cut(seq, rest + [EOS]) == len(rest) + 1
    assert cut(seq, rest + [EOS] + encode(" x")) == len(rest) + 1  # only stop ids after one
    assert cut(seq, rest + [EOS, EOS, EOS]) == len(rest) + 3  # (ignore_eos: the row goes on)
    assert cut(seq, rest + encode("x")) == len(rest)
    assert allowed_tokens(seq.matcher, len(VOCAB)).equal(before)

    class Free:
        matcher = None

    assert cut(Free(), encode("anything")) == len("anything")


def test_refused_draft_tokens_are_not_verified(setup, monkeypatch):
    """The engine verifies only the grammar-valid prefix of each draft: fewer draft tokens
    than with the cut turned off, the same accepted tokens and the same outputs."""
    model, compiler, prompts = setup
    cut = generate(model, compiler, prompts, 5, 8, 0.0)
    monkeypatch.setattr(logits_processing, "valid_draft_prefix", lambda seq, d: len(d))
    uncut = generate(model, compiler, prompts, 5, 8, 0.0)
    assert [c.output_ids for c in cut] == [c.output_ids for c in uncut]
    assert total(cut, "num_accepted_tokens") == total(uncut, "num_accepted_tokens")
    assert total(cut, "num_draft_tokens") < total(uncut, "num_draft_tokens")


def test_one_mask_call_after_bias_and_penalties_gives_the_rows_in_order(setup):
    """process_logits masks every row in one call after logit_bias and the penalties; the
    values equal masking each row first (vLLM's order), bit for bit, with a +100 bias on
    refused tokens, a repetition penalty and a row without a grammar between two with one."""
    import torch

    _, compiler, _ = setup
    from specbatch.engine.grammar import new_matcher

    class Row:
        def __init__(self, sp, text, grammar=True):
            self.sampling = sp
            self.matcher = (new_matcher(compiler.compile(SCHEMA), frozenset({EOS}))
                            if grammar else None)
            self.token_ids = encode("prompt " + text)
            self.num_prompt_tokens = len(encode("prompt "))
            self.output_ids = self.token_ids[self.num_prompt_tokens:]
            for tok in self.output_ids if grammar else []:
                assert self.matcher.accept_token(tok)

    bias = {VOCAB.index("x"): 100.0, VOCAB.index('"'): -3.0}
    sp = SamplingParams(logit_bias=bias, repetition_penalty=1.3, presence_penalty=0.5)
    rows = [Row(sp, '{"name": "abc"'), Row(sp, "free", grammar=False), Row(sp, '{"na')]
    drafts = [encode(', "o'), encode("ee"), encode('me')]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(sum(len(d) + 1 for d in drafts), len(VOCAB), generator=gen)
    out = logits_processing.process_logits(logits, rows, drafts)
    expected, start = logits.clone(), 0
    for row, d in zip(rows, drafts):  # the reference: each row masked first, then bias, penalties
        part = expected[start:start + len(d) + 1]
        if row.matcher is not None:
            logits_processing.apply_bitmask(part, logits_processing.grammar_masks(row, d,
                                                                                   len(VOCAB)))
        ids = torch.tensor([t for t, _ in row.sampling.logit_bias])
        part[:, ids] += torch.tensor([b for _, b in row.sampling.logit_bias])
        logits_processing._apply_penalties(part, row, d)
        start += len(d) + 1
    assert torch.equal(out, expected)
    assert torch.isinf(out[0]).sum() > 50 and not torch.isinf(out[len(drafts[0]) + 1]).any()
    assert out[0, VOCAB.index("x")] == float("-inf")  # refused: the +100 bias does not revive it


def test_cpu_greedy_path_equals_masked_sampling(setup, monkeypatch):
    """float32 on the CPU: all-greedy steps take the C greedy choice (``verify.greedy_accept``)
    with the step's grammar masks; outputs equal those of the torch path (masks applied, then
    the sampler), with and without a grammar, at k = 0 and 5."""
    from specbatch.engine import engine as engine_module

    model, compiler, prompts = setup
    model = tiny_llama(len(VOCAB), seed=5).float()
    taken = []

    def counting(*args):
        res = orig(*args)
        taken.append(res is not None)
        return res

    orig = engine_module.greedy_accept
    monkeypatch.setattr(engine_module, "greedy_accept", counting)
    sp = SamplingParams(max_tokens=40)
    free = [Request(i, p, sp, seed=i) for i, p in enumerate(prompts[:6])]
    fast = [generate(model, compiler, prompts, k, 8, 0.0) for k in (0, 5)]
    fast_free = sorted(make_engine(model, 5, 4, eos_ids=(EOS,)).generate(free),
                       key=lambda c: c.request.request_id)
    assert taken and all(taken)
    monkeypatch.setattr(engine_module, "greedy_accept", lambda *args: None)
    slow = [generate(model, compiler, prompts, k, 8, 0.0) for k in (0, 5)]
    free = [Request(i, p, sp, seed=i) for i, p in enumerate(prompts[:6])]
    slow_free = sorted(make_engine(model, 5, 4, eos_ids=(EOS,)).generate(free),
                       key=lambda c: c.request.request_id)
    for a, b in zip(fast + [fast_free], slow + [slow_free]):
        assert [c.output_ids for c in a] == [c.output_ids for c in b]
    assert [c.output_ids for c in fast[0]] == [c.output_ids for c in fast[1]]
    for c in fast[0]:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ignore_eos_after_the_json_is_the_same_whatever_the_drafts(setup, temperature):
    """With ignore_eos the JSON ends and only EOS may follow, position after position: drafts
    of EOS are accepted, and the position after one is masked as plain decoding masks it (a
    fresh-user defect: it was left unmasked, so ngram, suffix, batch size and order changed
    the tokens after the JSON)."""
    model, compiler, prompts = setup
    outs = [generate(model, compiler, prompts, k, b, temperature, ignore_eos=True)
            for k, b in ((0, 1), (5, 8), (5, 3))]
    for out in outs[1:]:
        assert [c.output_ids for c in out] == [c.output_ids for c in outs[0]]
    padded = 0
    for c in outs[0]:
        assert c.finish_reason == "length"
        end = c.output_ids.index(EOS) if EOS in c.output_ids else len(c.output_ids)
        jsonschema.validate(json.loads(detokenize(c.output_ids[:end])), SCHEMA)
        assert set(c.output_ids[end:]) <= {EOS}
        padded += len(c.output_ids) - end
    assert padded > 50
    assert total(outs[1], "num_accepted_tokens") > 0


def test_stop_token_ids_stop_inside_the_json(setup):
    """A stop_token_id that is an ordinary JSON token stops the row where the model emits it
    (vLLM's meaning), not only after the JSON: the grammar's end tokens are the EOS ids."""
    model, compiler, prompts = setup
    comma = VOCAB.index(",")
    outs = [generate(model, compiler, prompts, k, b, 0.0, stop_token_ids=[comma])
            for k, b in ((0, 1), (5, 8))]
    assert [c.output_ids for c in outs[1]] == [c.output_ids for c in outs[0]]
    for c in outs[0]:
        assert c.finish_reason == "stop" and c.stop_reason == comma
        assert detokenize(c.output_ids).startswith('{"name": "') and "," not in c.text


def test_min_tokens_past_the_json_is_a_clear_error(setup):
    """min_tokens longer than the JSON answer cannot be met (only EOS may follow the JSON, and
    EOS is banned until min_tokens): the record's error says so."""
    model, compiler, prompts = setup
    outs = generate(model, compiler, prompts[:2], 0, 1, 0.0, min_tokens=79)
    for c in outs:
        assert c.finish_reason == "error"
        assert c.error.startswith("min_tokens=79 cannot be met: the response_format JSON is "
                                  "complete after "), c.error


def test_one_compiler_per_tokenizer_keeps_its_schemas(tmp_path):
    """``pipeline`` takes the tokenizer's compiler for every ``generate`` call (building
    xgrammar's ``TokenizerInfo`` reads the vocabulary): the same object, with the schemas it
    compiled, until tokens are added or the vocabulary size differs."""
    from transformers import AutoTokenizer

    from tests.unit.test_dummy import write_word_tokenizer

    write_word_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    first = GrammarCompiler.for_tokenizer(tok, 256)
    assert GrammarCompiler.for_tokenizer(tok, 256) is first
    assert first.compile(SCHEMA) is GrammarCompiler.for_tokenizer(tok, 256).compile(SCHEMA)
    assert GrammarCompiler.for_tokenizer(tok, 320) is not first  # a larger lm_head
    tok.add_tokens(["w256"])
    assert GrammarCompiler.for_tokenizer(tok, 320) is not first
    other = AutoTokenizer.from_pretrained(tmp_path)
    assert GrammarCompiler.for_tokenizer(other, 256) is not first
