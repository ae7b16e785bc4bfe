"""A NaN from the model fails only the record whose row produced it.

A wrapper around the tiny model's forward poisons one request's row a few steps into its
generation: either only its logits, or its keys/values too (a NaN inside the model lands in the
KV cache, and that cache row is later reused by another request). The poisoned record ends with
``finish_reason == "error"`` and an ``error``; every other record gets exactly the tokens of a
clean run.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specbatch.config import SamplingParams
from specbatch.models.llama import LlamaForward
from specbatch.pipeline import generate_records
from tests.helpers import make_engine, repeating_prompts, run_engine, tiny_llama

VOCAB = 96
POISON_ID = VOCAB - 1  # only the poisoned prompt contains it
NUM_CLEAN_STEPS = 3  # decode steps the poisoned row runs before its NaN


class PoisonedForward:
    """``LlamaForward`` whose output for the row holding the poisoned prompt turns NaN after
    ``NUM_CLEAN_STEPS`` verify steps; with ``into_cache``, that step's keys/values too."""

    def __init__(self, model, into_cache: bool) -> None:
        self.inner = LlamaForward(model)
        # the runner's StepBackend is this wrapper: the inner backend, poisoned
        self.backend = self
        inner = self.inner.backend
        self.name, self.kv_dtype = inner.name, inner.kv_dtype
        self.min_query_len, self.prefill_per_token = inner.min_query_len, inner.prefill_per_token
        self.packed_attention = inner.packed_attention
        self.into_cache = into_cache
        self.poisoned_rows: dict[int, int] = {}  # cache row -> verify steps seen
        self.num_poisoned = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill(self, input_ids, cache, chunks, logits_at):
        """Packed prompt chunks: track which row holds the poisoned prompt."""
        c0 = 0
        for row, start, n in chunks:
            if start == 0:
                self.poisoned_rows.pop(row, None)
            if (input_ids[c0:c0 + n] == POISON_ID).any():
                self.poisoned_rows[row] = 0
            c0 += n
        return self.inner.backend.prefill(input_ids, cache, chunks, logits_at)

    @torch.inference_mode()
    def step(self, input_ids, positions, cache, rows, logits_index=None, num_fed=None):
        logits = self.inner.backend.step(input_ids, positions, cache, rows, logits_index, num_fed)
        for b, row in enumerate(rows.tolist()):
            if row not in self.poisoned_rows:
                continue
            self.poisoned_rows[row] += 1
            if self.poisoned_rows[row] == NUM_CLEAN_STEPS + 1:
                if logits.dim() == 2:  # packed: row b's real tokens, in row order
                    start = int(num_fed[:b].sum())
                    logits[start:start + int(num_fed[b])] = float("nan")
                else:
                    logits[b] = float("nan")
                self.num_poisoned += 1
                if self.into_cache:
                    for layer in range(len(cache.k)):
                        cache.k[layer][row, :, positions[b]] = float("nan")
                        cache.v[layer][row, :, positions[b]] = float("nan")
        return logits


def _prompts() -> list[list[int]]:
    """7 prompts of 20, 27, 13, 6, 9, 16, 23 tokens; the 27-token one (index 1) is poisoned.

    Over 3 rows, the short prompt 3 takes the poisoned row when it fails: a NaN key/value left
    at position 27+ would sit inside the key block the short prompt's attention reads."""
    base = repeating_prompts(VOCAB - 1, 7, seed=3)  # ids < POISON_ID
    prompts = [base[i] for i in (2, 3, 1, 0, 4, 5, 6)]
    prompts[1] = prompts[1][:4] + [POISON_ID] + prompts[1][5:]
    return prompts


@pytest.mark.parametrize("into_cache", [False, True])
@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32: the C greedy path
def test_nan_fails_only_its_record(into_cache, k, dtype):
    model = tiny_llama(VOCAB, seed=5).to(dtype)
    prompts = _prompts()
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    # 7 prompts over 3 rows: the poisoned row is reused by later requests
    clean = run_engine(model, prompts, k=k, batch_size=3, sampling=sampling)
    poisoned_forward = PoisonedForward(model, into_cache)
    got = run_engine(poisoned_forward, prompts, k=k, batch_size=3, sampling=sampling)

    assert poisoned_forward.num_poisoned == 1
    bad = got[1]
    assert bad.finish_reason == "error" and bad.error == "NaN in the target's logits"
    assert 1 <= len(bad.output_ids) < 12  # it got some way before failing
    assert bad.output_ids == clean[1].output_ids[:len(bad.output_ids)]
    for i, (c, g) in enumerate(zip(clean, got)):
        if i != 1:
            assert g.finish_reason == "length" and g.error is None, (i, g.error)
            assert g.output_ids == c.output_ids, i


def test_error_record_output_fields():
    """Through ``generate_records`` (what ``specbatch run`` writes): ``finish_reason: error``
    and the ``error`` text on the poisoned record only."""
    model = tiny_llama(VOCAB, seed=5)
    prompts = _prompts()
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    records = [SimpleNamespace(index=i, id=f"r{i}", prompt="x", messages=None, turns=None,
                               sampling=sampling, ids=p) for i, p in enumerate(prompts)]
    renderer = SimpleNamespace(first_prompt=lambda rec: (list(rec.ids), None))
    engine = make_engine(PoisonedForward(model, into_cache=True), k=3, batch_size=3)
    outs = {rec.index: out for rec, out in generate_records(engine, renderer, records)}

    assert sorted(outs) == list(range(len(prompts)))
    assert outs[1]["finish_reason"] == "error"
    assert outs[1]["error"] == "NaN in the target's logits"
    for i, out in outs.items():
        if i != 1:
            assert out["finish_reason"] == "length" and "error" not in out, (i, out)
            assert len(out["output_token_ids"]) == 12
