"""Where a batch-1 decode step of specbatch's one-call C path goes, part by part.

    python benchmarks/decode_parts.py --model qwen2.5-coder-1.5b --threads 1 \
        --prompts /work/qwen-run/prompts.json [--dtype auto] [--isa vnni avx2]

Loads the model (``--dtype auto``: int8 for a GGUF of codes the int8 kernels take), prefills
one prompt of ``prompts.json`` (``prepare.py``'s) on the step backend and then times, best of
``--reps`` passes (each part repeated ``--steps`` times in a pass), wall and CPU
(``time.process_time``, every thread of the process):

- ``step``: the backend's whole decode step (``CpuBackend.step``: embedding, the one C call
  over every layer, the final norm, the lm_head), one token at the prompt's end, plus the
  greedy choice (``select_cpu``) the engine then makes;
- ``layers``: the one C call alone (``kernels/decode_cpu.py``);
- per kind of dense weight (q/k/v, o, gate/up, down, summed over the layers, one row, in layer
  order so that the weights come from memory as in a step) and the lm_head: ``linear_cpu.linear``
  on its kernel form; ``x8 only``: the same calls on the first 16 columns of each weight kind,
  i.e. the activation rounding to 8 bits and the call's fixed cost without the weights;
- ``attention``: ``attention_cpu.attention`` of one token per layer at the prompt's length;
- ``glue``: ``layers`` minus the matmuls and the attention (norms, rope, cache writes, SiLU,
  residual adds, buffer allocation);
- ``greedy``: the choice over the vocabulary.

Weight bytes per step (codes and scales of the kernel form) are printed beside the matmuls,
with the GB/s they imply. ``--isa`` repeats the matmul rows for each int8 kernel named.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def timed(fn, steps: int, reps: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per call: best of reps passes of steps calls each"""
    wall, cpu = float("inf"), float("inf")
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            fn()
        wall = min(wall, (time.perf_counter() - t0) / steps * 1e3)
        cpu = min(cpu, (time.process_time() - c0) / steps * 1e3)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", required=True, help="prepare.py's prompts.json")
    ap.add_argument("--prompt", type=int, default=0, help="which prompt (index)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--isa", nargs="*", default=[], help="int8 kernels to time the matmuls on "
                    "(vnni, avx2, portable)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specbatch import LLM
    from specbatch.kernels import attention_cpu, linear_cpu, select_cpu

    llm = LLM(args.model, method="none", dtype=args.dtype, max_batch_size=1)
    runner = llm.new_runner(1)
    f = runner.forward
    be = f.backend
    assert be.decode is not None, f"not the one-call C step: {be.name}"
    ids = json.load(open(args.prompts))[args.prompt]["prompt_ids"]
    n = len(ids)
    cache = f.new_cache(1, n + 64)
    with torch.inference_mode():
        logits = be.prefill(torch.tensor(ids), cache, [(0, 0, n)], [n - 1])
    tok = int(logits[0].argmax())
    rows = torch.zeros(1, dtype=torch.int64)
    pos = torch.tensor([[n]])
    ids1 = torch.tensor([[tok]])
    print(f"{llm.model_id}: {f.activations} activations, backend {be.name}, int8 kernel "
          f"{linear_cpu.int8_kernel()}, {args.threads} thread(s), prompt {n} tokens, vocab "
          f"{f.vocab_size}")

    parts: dict[str, tuple[float, float]] = {}
    with torch.inference_mode():
        def step():  # the same position each time: rewrites the same cache slot
            out = be.step(ids1, pos, cache, rows)
            select_cpu.greedy_select(out.view(-1, out.shape[-1]), torch.zeros(1, dtype=torch.int64))
        parts["step + greedy"] = timed(step, args.steps, args.reps)
        cos, sin = f._rope(pos)
        cos, sin = cos.flatten(0, 1).flatten(1), sin.flatten(0, 1).flatten(1)
        scale = be.head_dim ** -0.5
        h0 = torch.nn.functional.embedding(ids1.flatten(), f.embed)

        def layers():
            be.decode(h0.clone(), cos, sin, cache.k, cache.v, rows, pos.flatten(), scale)
        parts["layers (one C call)"] = timed(layers, args.steps, args.reps)
        kinds = {"q/k/v": [w for w, _ in f.qkv],
                 "o": [layer.self_attn.o_proj.weight for layer in f.layers],
                 "gate/up": f.gate_up,
                 "down": [layer.mlp.down_proj.weight for layer in f.layers],
                 "lm_head": [f.lm_head]}
        biases = {"q/k/v": [b for _, b in f.qkv]}

        def matmuls(name, isa=None):
            ws = kinds[name]
            xs = torch.randn(1, ws[0].shape[1])
            bs = biases.get(name, [None] * len(ws))
            total = sum(linear_cpu.form_bytes(w) for w in ws)
            kinds_seen = sorted({linear_cpu.packed(w)[0] for w in ws})
            wall, cpu = timed(lambda: [linear_cpu.linear(xs, w, b) for w, b in zip(ws, bs)],
                              max(1, args.steps // 2), args.reps)
            return wall, cpu, total, kinds_seen

        mm_total = [0.0, 0.0]
        rows_out = []
        for name in kinds:
            wall, cpu, nbytes, ks = matmuls(name)
            rows_out.append((name, wall, cpu, nbytes, ks))
            if name != "lm_head":
                mm_total[0] += wall
                mm_total[1] += cpu
        # the call's fixed cost and the activation rounding: a 16-column slice of each kind
        small = 0.0, 0.0
        for name in ("q/k/v", "o", "gate/up", "down"):
            k = kinds[name][0].shape[1]
            w16 = kinds[name][0]
            x = torch.randn(1, k)
            form = linear_cpu.packed(w16)
            lib = linear_cpu._library()
            y = torch.empty(1, 16)
            if form[0] in linear_cpu.INT8_KINDS and form[0] != linear_cpu.SEGMENTS:
                def one():
                    lib.sb_linear_quant(x.data_ptr(), k, form[0], form[1].data_ptr(),
                                        form[2].data_ptr(), None, y.data_ptr(), 16, 1, 16, k)
                w_, c_ = timed(one, 64, args.reps)
                small = small[0] + w_ * len(kinds[name]), small[1] + c_ * len(kinds[name])
        attn_t = (0.0, 0.0)
        q = torch.randn(1, f.num_heads, be.head_dim)
        for i in range(f.num_layers):
            def att(i=i):
                attention_cpu.attention(q, cache.k[i], cache.v[i], rows, pos.flatten(),
                                        scale=scale)
            w_, c_ = timed(att, args.steps, args.reps)
            attn_t = attn_t[0] + w_, attn_t[1] + c_
        logits = torch.randn(1, f.vocab_size)
        parts["greedy (select_cpu)"] = timed(
            lambda: select_cpu.greedy_select(logits, torch.zeros(1, dtype=torch.int64)),
            args.steps * 4, args.reps)
        parts["argmax (torch)"] = timed(lambda: logits.argmax(-1), args.steps * 4, args.reps)

    print(f"{'part':34s} {'wall ms':>8s} {'CPU ms':>8s} {'MB':>7s} {'GB/s':>6s}")
    for name, (w, c) in parts.items():
        print(f"{name:34s} {w:8.2f} {c:8.2f}")
    for name, w, c, nbytes, ks in rows_out:
        print(f"{'matmul ' + name + ' ' + str(ks):34s} {w:8.2f} {c:8.2f} {nbytes / 1e6:7.1f} "
              f"{nbytes / 1e6 / w:6.1f}")
    print(f"{'matmuls of the layers':34s} {mm_total[0]:8.2f} {mm_total[1]:8.2f}")
    print(f"{'  x8 only (16 columns per call)':34s} {small[0]:8.2f} {small[1]:8.2f}")
    print(f"{'attention (28 calls)':34s} {attn_t[0]:8.2f} {attn_t[1]:8.2f}")
    lw, lc = parts["layers (one C call)"]
    print(f"{'glue = layers - matmuls - attention':34s} {lw - mm_total[0] - attn_t[0]:8.2f} "
          f"{lc - mm_total[1] - attn_t[1]:8.2f}")
    for isa in args.isa:
        linear_cpu.int8_kernel(isa)
        with torch.inference_mode():
            for name in kinds:
                w, c, nbytes, ks = matmuls(name)
                print(f"{isa + ' matmul ' + name:34s} {w:8.2f} {c:8.2f} {nbytes / 1e6:7.1f} "
                      f"{nbytes / 1e6 / w:6.1f}")
    linear_cpu.int8_kernel("vnni")


if __name__ == "__main__":
    main()
