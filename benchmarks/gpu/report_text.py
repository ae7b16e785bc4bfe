"""The text form of the GPU check's JSON (``gpu_check.txt``): what a person reads first."""

from __future__ import annotations


def render(doc: dict) -> str:
    s = doc.get("settings", {})
    env = doc.get("env", {})
    lines = [f"specbatch GPU check: {doc.get('status')} in {doc.get('wall_s', 0):.0f} s"]
    if env:
        where = env.get("device_name") or f"CPU ({env.get('cpu_count')} cores)"
        lines.append(f"device {where}; Python {env.get('python')}, torch {env.get('torch')}, "
                     f"triton {env.get('triton')}, transformers {env.get('transformers')}")
    if s:
        lines.append(f"settings: {s.get('records')} records, max_tokens {s.get('max_tokens')}, "
                     f"k {s.get('k')}, dtype {s.get('dtype')}, batches "
                     f"{'/'.join(map(str, s.get('batches', [])))}, methods "
                     f"{'/'.join(s.get('methods', []))}")
    for failure in doc.get("failures", []):
        lines.append(f"FAILED {failure}")
    for note in doc.get("incomplete", []):
        lines.append(f"incomplete: {note}")
    kt = doc.get("kernel_tests")
    if kt:
        lines.append("")
        lines.append(f"kernel tests: {kt.get('status', kt.get('skipped'))}: "
                     f"{kt.get('summary', '')} ({kt.get('seconds', '-')} s)")
        if kt.get("note"):
            lines.append(f"  {kt['note']}")
        else:
            lines += [f"  {ln}" for ln in kt.get("failed", [])[:10]]
    probe = doc.get("probe")
    if probe:
        lines += [""] + probe_lines(probe)
    for model, m in doc.get("models", {}).items():
        lines += [""] + model_lines(model, m)
    return "\n".join(lines)


def probe_lines(p: dict) -> list[str]:
    setting = (f"; cuBLAS with the {p['cublas_setting']} setting" if p.get("cublas_setting")
               else "")
    lines = [f"row invariance of the dense layers (matmuls: {', '.join(p.get('impls', []))}"
             f"{setting})"]
    probe = p.get("probe")
    if isinstance(probe, str):
        lines.append(f"  probe: {probe}")
    elif isinstance(probe, dict):
        for name, result in probe.items():
            if "error" in result:
                lines.append(f"  {name}: {result['error']}")
                continue
            bad = [f"{shape} at rows {r['mismatched_rows'][:6]}"
                   for shape, r in result.get("shapes", {}).items() if not r["invariant"]]
            lines.append(f"  {name}: " + ("row-invariant on every shape" if result["invariant"]
                                          else "NOT row-invariant: " + "; ".join(bad)))
    for key in ("triton_matmul", "rms_norm"):
        if key in p:
            lines.append(f"  {key}: {short(p[key])}")
    for model, impls in p.get("dense_step_ms", {}).items():
        base_name = next(iter(impls), None)
        base = impls.get(base_name, {})
        lines.append(f"  one step's dense matmuls, {model}, ms at rows "
                     f"{'/'.join(base.keys())}:")
        for name, by_rows in impls.items():
            cells = []
            for r, ms in by_rows.items():
                ratio = (f" ({ms / base[r]:.2f}x)" if name != base_name and isinstance(ms, float)
                         and isinstance(base.get(r), float) else "")
                cells.append(f"{ms:.3f}{ratio}" if isinstance(ms, float) else str(ms))
            lines.append(f"    {name}: {' / '.join(cells)}")
    cost = p.get("dense_cost_plain_cublas")
    if cost:
        if "error" in cost:
            lines.append(f"  dense_cost.py: {cost['error']}")
        else:
            step = cost.get("step", {})
            cells = [f"{m} rows {step['cublas_us'][m]:.0f} vs {step['triton_us'][m]:.0f} us "
                     f"({step['ratio'][m]:.2f}x)" for m in step.get("ratio", {})]
            lines.append(f"  plain cuBLAS vs Triton matmul, one 1.5B step's dense matmuls "
                         f"(dense_cost.py, eager): {'; '.join(cells)}")
            for lname, rep in (cost.get("probe") or {}).items():
                ok = all(r["invariant"] for r in rep.values())
                lines.append(f"    probe, {lname} (default setting): "
                             + ("row-invariant" if ok else "NOT row-invariant"))
    for line in p.get("errors", []) + p.get("log_tail", [])[-3:]:
        lines.append(f"  ! {line}")
    return lines


def short(value, limit: int = 300) -> str:
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def model_lines(model: str, m: dict) -> list[str]:
    params = m.get("parameters")
    lines = [f"{model} ({m.get('model_id', '?')}; "
             + (f"{params / 1e6:.1f} M parameters, " if params else "")
             + f"{m.get('dtype', '?')}): load {m.get('load_s', '-')} s, warm-up "
             f"(compiles, auto's calibration) {m.get('warmup_s', '-')} s, phase "
             f"{m.get('seconds', '-')} s" + (" (TIMED OUT)" if m.get("timed_out") else "")]
    engine = m.get("engine")
    if engine:
        lines.append(f"  engine: dense layers on {engine['dense']}, Triton kernels "
                     + ("on" if engine["triton_kernels"] else "off"))
    floor = m.get("floor")
    if floor:
        lines.append(f"  floor: {floor['streamed_weight_bytes'] / 2**20:.0f} MiB of weights per "
                     f"step / {floor['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s copy "
                     f"bandwidth = {floor['floor_us']:.0f} us")
    for st in m.get("steps", []):
        if "error" in st:
            lines.append(f"  step {st['rows']}x{st['tokens']}: {st['error']}")
        else:
            fed = "" if st["fed_tokens"] == st["tokens"] else f" (runs as {st['fed_tokens']} tokens)"
            lines.append(f"  step {st['rows']:>2} rows x {st['tokens']} tokens{fed} at context "
                         f"{st['context']}: {st['us']:8.0f} us = {st['x_floor']:.1f}x the floor")
    runs = m.get("runs", [])
    if runs:
        lines.append("  method  batch rows tokens  wall s    tok/s  acc.len")
        for r in runs:
            if "error" in r:
                lines.append(f"  {r['method']:<7} {r['batch']:>5}  {r['error']}")
                continue
            acc = r.get("mean_acceptance_length")
            lines.append(f"  {r['method']:<7} {r['batch']:>5} {r['rows']:>4} {r['tokens']:>6} "
                         f"{r['wall_s']:>7.2f} {r['tok_s']:>8.1f}  "
                         + (f"{acc:.2f}" if acc and r["method"] != "none" else "-"))
        n_ok = len([r for r in runs if "error" not in r])
        lines.append(f"  outputs identical across {n_ok} runs: "
                     + ("yes" if m.get("identical") else "NO"))
        for mm in m.get("mismatches", []):
            lines.append(f"    {mm['run']} vs {mm['against']}: {mm['records_differing']} records "
                         f"differ, first {mm['first_record']} at {mm['first_position']}")
    hf = m.get("hf", [])
    if hf:
        lines.append("  none vs transformers generate (first turns, greedy, max_tokens each):")
        for h in hf:
            if "error" in h:
                lines.append(f"    batch {h['batch']}: {h['error']}")
                continue
            lines.append(f"    batch {h['batch']:>2} ({h['rows']} rows, {h['records']} records): "
                         f"specbatch {h['specbatch_tok_s']:.1f} tok/s, transformers "
                         f"{h['transformers_tok_s']:.1f} tok/s ({h['ratio']:.2f}x); same tokens "
                         f"for {h['same_tokens']}/{h['records']} records")
    for line in m.get("errors", []):
        lines.append(f"  ! {line}")
    for line in m.get("skipped", []):
        lines.append(f"  skipped {line}")
    if m.get("returncode"):
        lines += [f"  | {ln}" for ln in m.get("log_tail", [])[-8:]]
    return lines
