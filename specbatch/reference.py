"""Compare a ``specbatch run`` output file with transformers' greedy ``generate``.

For every answer in ``OUT.jsonl`` this re-renders the prompt exactly as
``prompts.PromptRenderer`` does, runs transformers' ``generate`` (greedy, batch 1, the same
model, dtype and EOS ids, ``max_new_tokens`` = the record's ``max_tokens``; a run in ``int8``,
which ``--dtype auto`` takes for a quantised GGUF on x86-64, against transformers in float32
on the same weights: ``compared_dtypes`` says which, first) and reports the first
output position where the token ids differ. There it gives the logit margins that show whether
the difference sits at a near-tie:

    ref_margin   top-1 minus top-2 of transformers' logits at that position
    our_margin   top-1 minus top-2 of our logits at that position
    ref_gap      transformers' logit of its token minus its logit of our token (>= ref_margin)
    our_gap      our logit of our token minus our logit of transformers' token
    max_abs_diff max |ours - transformers'| over the vocabulary at that position

Both sides see the same prefix there (it is the *first* difference), so ``max_abs_diff`` is the
numerical noise between the two forwards, and a flip is explained when ``ref_gap`` is of that
size. Our logits are recomputed by replaying the recorded tokens through our own runner one
token at a time (prefill, then k = 0 decode steps, as ``--method none`` runs them); in bfloat16
the decode path is batch-invariant, so these are the logits the run itself saw. The replay also
checks that our argmax reproduces every recorded token up to the difference (``replay_ok``).

``turns`` records: every turn is compared. Turn i's prompt is built from the earlier user turns
and the *recorded* answers (the ``output`` strings), exactly the context the run generated turn
i from, so a difference in an early turn does not make later turns incomparable.

Only greedy runs can be compared: a record with temperature > 0, stop strings, stop ids,
``min_tokens`` or ``ignore_eos`` raises ``ValueError``.

    python -m specbatch.reference OUT.jsonl [--limit N] [--model NAME] [--input PATH]
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

NEAR_TIE = 0.5  # default threshold (logits) for calling a difference a near-tie; see docs


@dataclass
class TurnComparison:
    """One answer compared. Positions count output tokens (0 = first generated token)."""

    record_id: str | int
    turn: int
    num_tokens: int  # our output tokens (incl. a final EOS)
    num_ref_tokens: int  # transformers' output tokens (incl. a final EOS)
    first_diff: int | None = None  # None: identical
    our_token: int | None = None  # None: our output ended here
    ref_token: int | None = None  # None: transformers' output ended here
    ref_margin: float | None = None
    our_margin: float | None = None
    ref_gap: float | None = None
    our_gap: float | None = None
    max_abs_diff: float | None = None
    replay_ok: bool | None = None  # our replay reproduced the recorded prefix

    @property
    def identical(self) -> bool:
        return self.first_diff is None

    def is_near_tie(self, threshold: float = NEAR_TIE) -> bool:
        """True when the first difference is a flip between two tokens whose logits are within
        ``threshold`` of each other on both sides (and our replay matched the run)."""
        if self.identical:
            return True
        return (self.ref_gap is not None and self.our_gap is not None and bool(self.replay_ok)
                and self.ref_gap <= threshold and self.our_gap <= threshold)


def _margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits.double(), 2).values
    return float(top[0] - top[1])


def _check_greedy(rec) -> None:
    sp = rec.sampling
    bad = [name for name, is_bad in (
        ("temperature", sp.temperature != 0), ("stop", bool(sp.stop)),
        ("stop_token_ids", bool(sp.stop_token_ids)), ("min_tokens", sp.min_tokens != 0),
        ("ignore_eos", sp.ignore_eos)) if is_bad]
    if bad:
        raise ValueError(f"record id={rec.id!r}: only plain greedy runs can be compared with "
                         f"transformers generate; this one sets {', '.join(bad)}")


class _Replayer:
    """Our runner on one row, replaying recorded tokens (k = 0) to get our logits."""

    def __init__(self, llm, max_model_len: int) -> None:
        self.runner = llm.new_runner(1, max_model_len)  # ``llm.LLM``: the one builder
        self.max_model_len = max_model_len

    def logits_at(self, prompt_ids: list[int], output_ids: list[int],
                  position: int) -> tuple[torch.Tensor, bool]:
        """Our logits ``[vocab]`` predicting output token ``position``, and whether our argmax
        reproduced ``output_ids[:position]`` on the way."""
        from specbatch.config import SamplingParams
        from specbatch.engine.sequence import Request, Sequence
        from specbatch.spec_decode.sampler import argmax_lowest

        seq = Sequence(Request(0, list(prompt_ids), SamplingParams()), "none", 0)
        seq.row = 0
        self.runner.cache.reset(0)
        logits = self.runner.prefill([seq])[0]
        ok = True
        for t in range(position):
            ok &= int(argmax_lowest(logits.float())) == output_ids[t]
            seq.token_ids.append(output_ids[t])  # the cache holds all but this token
            logits = self.runner.verify([seq], [[]])[0]
        return logits, ok


def compare_turn(loaded, replayer: _Replayer, record_id, turn: int, prompt_ids: list[int],
                 output_ids: list[int], max_tokens: int) -> TurnComparison:
    """Greedy-generate ``prompt_ids`` with transformers and compare with ``output_ids``."""
    model = loaded.model
    eos = list(loaded.eos_token_ids)
    max_new = min(max_tokens, loaded.max_model_len - len(prompt_ids))
    inp = torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        gen = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new,
                             do_sample=False, num_beams=1, eos_token_id=eos or None,
                             pad_token_id=eos[0] if eos else None, output_logits=True,
                             return_dict_in_generate=True)
    ref_ids = gen.sequences[0, len(prompt_ids):].tolist()
    ref_ids = ref_ids[:len(gen.logits)]
    row = TurnComparison(record_id, turn, len(output_ids), len(ref_ids))
    d = next((i for i, (a, b) in enumerate(zip(output_ids, ref_ids)) if a != b),
             None if len(output_ids) == len(ref_ids) else min(len(output_ids), len(ref_ids)))
    if d is None:
        return row
    row.first_diff = d
    row.our_token = output_ids[d] if d < len(output_ids) else None
    row.ref_token = ref_ids[d] if d < len(ref_ids) else None
    if row.our_token is None or row.ref_token is None:
        return row  # one side stopped early: not a token flip
    ref_logits = gen.logits[d][0].double()
    ours, row.replay_ok = replayer.logits_at(prompt_ids, output_ids, d)
    ours = ours.double()
    row.ref_margin = _margin(ref_logits)
    row.our_margin = _margin(ours)
    row.ref_gap = float(ref_logits[row.ref_token] - ref_logits[row.our_token])
    row.our_gap = float(ours[row.our_token] - ours[row.ref_token])
    row.max_abs_diff = float((ours - ref_logits).abs().max())
    row.replay_ok &= int(torch.argmax(ours)) == row.our_token
    return row


def _load_config(out_path: Path) -> dict:
    cfg_path = out_path.with_name(out_path.name + ".config.json")  # as io.writer names it
    if not cfg_path.exists():
        raise ValueError(f"{cfg_path} not found: it is written by `specbatch run` beside OUT")
    return json.loads(cfg_path.read_text())


def _match_records(records, rows: list[dict]) -> list[tuple]:
    """Pair output rows (input order, skipped records absent) with input records."""
    pairs, i = [], 0
    for row in rows:
        while i < len(records) and any(row.get(k) != v for k, v in records[i].fields.items()):
            i += 1
        if i == len(records):
            raise ValueError("an output row matches no input record: is the input file the one "
                             "the run read?")
        pairs.append((records[i], row))
        i += 1
    return pairs


def compared_dtypes(out_path: str | Path) -> str:
    """One line saying what ``compare_outputs`` compares for the run at ``out_path``: the
    run's dtype (from ``OUT.config.json``, with why ``--dtype auto`` chose it) against
    transformers' forward in the dtype of the weights it loads: the same one, except that
    ``int8`` (8-bit activations in specbatch's C kernels only) loads float32 weights. Raises
    ``ValueError`` where the config is missing."""
    cfg = _load_config(Path(out_path))
    dtype = cfg.get("dtype", "?")
    why = f" (dtype auto: {cfg['dtype_auto']})" if cfg.get("dtype_auto") else ""
    if dtype == "int8":
        return (f"comparing specbatch int8{why} with transformers float32 on the same weights: "
                "int8 is llama.cpp's scheme (8-bit activations per block of 32), not bit-equal "
                "to float32, so differences past near-ties are expected; rerun with --dtype "
                "float32 to compare float32")
    return f"comparing specbatch {dtype}{why} with transformers {dtype} on the same weights"


def compare_outputs(out_path: str | Path, limit: int | None = None, model: str | None = None,
                    input_path: str | None = None, cache_dir: str | None = None,
                    progress: bool = False) -> list[TurnComparison]:
    """Compare the first ``limit`` records of a ``specbatch run`` output with transformers.

    Reads ``OUT.config.json`` for the input file, model, dtype, sampling defaults and record
    options (``model`` / ``input_path`` override). Returns one ``TurnComparison`` per answer.
    progress: print one line per answer (with its time) to stderr.
    Raises ``ValueError`` for a non-greedy record or an output that does not fit the input.
    """
    from specbatch.config import EngineConfig, SamplingParams, SpecConfig
    from specbatch.io.records import read_records
    from specbatch.llm import LLM

    out_path = Path(out_path)
    cfg = _load_config(out_path)
    rows = [json.loads(line) for line in out_path.read_text().splitlines() if line.strip()]
    rows = rows[:limit] if limit is not None else rows
    defaults = SamplingParams.from_dict(cfg["sampling"])  # the inverse of to_dict
    records, _ = read_records(input_path or cfg["input"], prompt_field=cfg.get("prompt_field"),
                              id_field=cfg.get("id_field"), split=cfg.get("split"),
                              defaults=defaults)
    pairs = _match_records(records, rows)
    for rec, _ in pairs:
        _check_greedy(rec)
    llm = LLM.from_config(model or cfg["model"].split("@sha256:")[0], SpecConfig(method="none"),
                          EngineConfig(dtype=cfg["dtype"],
                                       max_model_len=cfg.get("max_model_len")),
                          cache_dir=cache_dir)
    loaded, renderer, max_model_len = llm.loaded, llm.renderer, llm.max_model_len
    if cfg["dtype"] == "int8":  # the int8 model's code weights hold no float32 values (their
        # codes only: backends.cpu.Int8Weights); transformers gets a float32 copy
        from dataclasses import replace

        from specbatch.models.loader import load_model

        loaded = replace(loaded, model=load_model(loaded.source.name, "float32",
                                                  cache_dir=cache_dir).model)
    replayer = _Replayer(llm, max_model_len)
    result = []
    for rec, row in pairs:
        if rec.turns is None:
            prompts, outputs = [renderer.first_prompt(rec)[0]], [row["output_token_ids"]]
        else:  # the context of turn i holds the recorded answers, as pipeline.follow_up built it
            messages = renderer.first_prompt(rec)[1]
            prompts, outputs = [], row["output_token_ids"]
            for turn in range(len(outputs)):
                if turn > 0:
                    messages = messages + [
                        {"role": "assistant", "content": row["output"][turn - 1]},
                        {"role": "user", "content": rec.turns[turn]}]
                prompts.append(renderer.encode_chat(messages))
        for turn, (prompt_ids, output_ids) in enumerate(zip(prompts, outputs)):
            t0 = time.perf_counter()
            result.append(compare_turn(loaded, replayer, rec.id, turn, prompt_ids, output_ids,
                                       rec.sampling.max_tokens))
            if progress:
                r = result[-1]
                print(f"id={rec.id} turn {turn}: {len(prompt_ids)} prompt tokens, "
                      f"{'identical' if r.identical else f'differs at {r.first_diff}'} "
                      f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return result


def format_table(rows: list[TurnComparison], threshold: float = NEAR_TIE) -> str:
    """One line per answer, then a summary line."""
    def f(x):
        return "-" if x is None else f"{x:.3f}"

    lines = [f"{'id':>8} {'turn':>4} {'tokens':>7} {'first diff':>11} {'ours/ref token':>15} "
             f"{'ref margin':>10} {'our margin':>10} {'ref gap':>8} {'our gap':>8} "
             f"{'|diff|max':>9}"]
    for r in rows:
        where = "identical" if r.identical else str(r.first_diff)
        toks = "" if r.identical else f"{r.our_token}/{r.ref_token}"
        lines.append(f"{str(r.record_id):>8} {r.turn:>4} {r.num_tokens:>7} {where:>11} "
                     f"{toks:>15} {f(r.ref_margin):>10} {f(r.our_margin):>10} {f(r.ref_gap):>8} "
                     f"{f(r.our_gap):>8} {f(r.max_abs_diff):>9}"
                     + ("" if r.replay_ok in (None, True) else "  replay mismatch"))
    n_same = sum(r.identical for r in rows)
    n_tie = sum((not r.identical) and r.is_near_tie(threshold) for r in rows)
    lines.append(f"{len(rows)} answers: {n_same} identical, {n_tie} differ at a near-tie "
                 f"(gap <= {threshold} logits), {len(rows) - n_same - n_tie} other differences")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m specbatch.reference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output file of `specbatch run` (its .config.json beside it)")
    p.add_argument("--limit", type=int, default=None, help="first N records only")
    p.add_argument("--model", default=None, help="override the model in OUT.config.json")
    p.add_argument("--input", default=None, help="override the input file in OUT.config.json")
    p.add_argument("--threshold", type=float, default=NEAR_TIE,
                   help="near-tie threshold (logits)")
    p.add_argument("--json", default=None, help="also write the rows as JSONL here")
    args = p.parse_args(argv)
    try:
        print(compared_dtypes(args.out), flush=True)
        rows = compare_outputs(args.out, args.limit, args.model, args.input, progress=True)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    print(format_table(rows, args.threshold))
    if args.json:
        Path(args.json).write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))
    return 0 if all(r.is_near_tie(args.threshold) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
