"""A row-invariant float32 matmul for x86-64 CPUs (AVX2 + FMA), in C: ``csrc/linear_f32.c``.

The engine's float32 dense layers need a matmul whose row ``i`` has the same bits whatever the
number of rows beside it (``specbatch/models/dense.py``). oneDNN's inner product gives that, but
it pays for every extra row from two rows up, although a step of up to ~16 rows should cost what
streaming the weights once costs. This kernel keeps one fixed reduction order per output element
(see the C file) and streams a packed copy of the weight once per 4 rows. All dense layers of
one SmolLM2-135M step: ``python benchmarks/dense_rows.py``, figures in docs/benchmarks.md.
Built and loaded by ``kernels/cpu_build.py``; ``SPECBATCH_CPU_LINEAR=onednn`` keeps oneDNN.

**Exact low-bit weights.** A model loaded from a GGUF (the bundled SmolLM2-135M is Q4_1, with a
Q8_0 embedding / lm_head) has float32 weights that are exactly ``d * q + m`` or ``d * q`` per
block of 32. ``pack_quantized`` finds those codes and checks that they give back every weight
bit for bit; the kernel then streams the codes (5-6 bits a weight instead of 32), rebuilds each
block of weights in float32 and runs the same float32 arithmetic on it. Outputs are the float32
kernel's bit for bit (the weights are the same numbers), so nothing about invariance changes;
a batch-1 step reads ~6x fewer weight bytes. A weight that is not exactly representable keeps
the float32 path; ``SPECBATCH_CPU_WEIGHTS=float32`` keeps it for every weight.

**8-bit activations** (``--dtype int8``): a weight marked by ``use_int8_activations`` is packed
by ``pack_q8`` for ``csrc/linear_q8.c``, which rounds each row of x to 8 bits per block of 32
and sums exact integer products with the codes (llama.cpp's scheme; docs/design.md). GGUF
K-quant weights (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1 ones take that path too, their codes read
from the GGUF file (``kernels/kquant.py``: by tensor name at an int8 load, ``pack_runs`` and
``set_int8_form``; else by value, ``pack_q8``); a weight fused from rows of several kinds
(q/k/v) runs as row segments.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from specbatch import settings

from . import cpu_build


def released(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s values were released (``models.dense.release_float32``: a
    zero-stride view of one float)."""
    return weight.numel() > 1 and all(s == 0 for s in weight.stride())

NR = 3  # weight rows per packed panel (csrc/linear_f32.c)
BLOCK = 32  # k per quantisation block (GGUF's Q4_1 / Q8_0)
Q4_1, Q8_0 = 1, 2  # the C kernel's codes for the two storage kinds
Q4_1_X8, Q8_0_X8 = 3, 4  # the same codes with 8-bit activations (csrc/linear_q8.c)
Q6_K_X8 = 5  # GGUF Q6_K: 6-bit codes, its own scales (int8 per 16 k, float16 per 256)
SEGMENTS = 6  # rows in runs of different kinds (csrc/linear_f32.c, sb_segment)
Q5_K_X8 = 7  # GGUF Q5_K: 8-bit-code layout, Q4_1's (d, m) scales
Q4_K_X8 = 8  # GGUF Q4_K: Q4_1's codes, its own scales (6-bit per 32 k, float16 per 256)
INT8_KINDS = (Q4_1_X8, Q8_0_X8, Q6_K_X8, SEGMENTS, Q5_K_X8, Q4_K_X8)


def _library():
    if not settings.cpu_linear():
        return None
    return cpu_build.library()


def available() -> bool:
    """Whether ``linear`` can run here (builds the C kernels on first call)."""
    return _library() is not None


def avx512(enable: bool | None = None) -> bool:
    """Whether the AVX-512 micro-kernels run the matmuls of 8 rows and more, and those of up to
    48 rows on code weights (from ``avx512_from_rows()`` rows), in passes of up to 8 rows (CPUs
    with AVX-512 F/VL/DQ; ``SPECBATCH_CPU_AVX512=0`` starts them off). They give every output
    element the AVX2 kernels' bits (two panels per 512-bit register, each half the AVX2 lanes'
    own arithmetic), ~1.6x faster on a prompt-sized matmul on an AVX-512 EPYC. ``enable``
    turns them on or off first (tests and A/B timings)."""
    lib = _library()
    if lib is None:
        return False
    return bool(lib.sb_linear_avx512(-1 if enable is None else int(enable)))


def avx512_from_rows(rows: int | None = None) -> int:
    """The fewest rows a pass of a code weight's matmul (``pack_quantized``: Q4_1 / Q8_0 at
    float32) takes on the AVX-512 kernel; fewer take the AVX2 one (where ``avx512()`` is on).
    Decided per CPU on first use: 1 on Intel CPUs (1-3 rows 1.2-1.3x faster there, an Emerald
    Rapids Xeon), 4 elsewhere (1-3 rows 0.73-0.95x as fast on an AVX-512 EPYC). ``rows`` (1-4)
    sets it first (tests and A/B timings); the bits are the same either way. Returns 0 where
    the kernels are not available."""
    lib = _library()
    if lib is None:
        return 0
    return int(lib.sb_linear_qmicro512_from(0 if rows is None else int(rows)))


# weight -> (its version, its form: see ``packed``); the form lives as long as the weight
_PACKED = WeakIdKeyDictionary()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of ``weight`` ``[N, K]`` float32: ``[ceil(N / 3), ceil(K / 8), 3,
    8]``, zero-padded (panel p = rows 3p..3p+2, eight k at a time): one more copy of the
    weight's bytes (``packed`` caches it)."""
    n, k = weight.shape
    panels, chunks = -(-n // NR), -(-k // 8)
    padded = weight.detach().new_zeros(panels * NR, chunks * 8)
    padded[:n, :k] = weight.detach()
    return padded.view(panels, NR, chunks, 8).transpose(1, 2).contiguous()


def _q8_0_codes(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """v ``[B, 32]`` float32 -> (d ``[B]`` float32, q ``[B, 32]`` int8) with ``d * q`` equal to v
    bit for bit (d a float16 value, so the product is exact), or None if some block has none.
    In chunks of ``_CHUNK`` blocks: the float temporaries of one chunk, not of the whole
    weight (SmolLM2's 28M-weight embedding: ~0.45 GB of them at once)."""
    d = torch.empty(v.shape[0], dtype=torch.float32)
    q = torch.empty(v.shape, dtype=torch.int8)
    for i in range(0, v.shape[0], _CHUNK):
        vc = v[i:i + _CHUNK]
        dc = vc.abs().amax(1) / 127  # the largest |q| is 127 where v came from Q8_0 (exact)
        safe = torch.where(dc > 0, dc, torch.ones_like(dc))
        qc = (vc / safe[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        rec = dc[:, None] * qc.float()  # what the kernel computes (a -0.0 cannot come back)
        if not bool(((dc.half().float() == dc)
                     & (rec.view(torch.int32) == vc.view(torch.int32)).all(1)).all()):
            return None
        d[i:i + _CHUNK], q[i:i + _CHUNK] = dc, qc
    return d, q


_CHUNK = 1 << 16  # blocks of 32 per step of the code searches


def _q4_1_codes(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """v ``[B, 32]`` float32 -> (d ``[B]``, m ``[B]`` float32, q ``[B, 32]`` uint8 in 0..15) with
    ``d * q + m`` (one rounding: d is a float16 value, d * q exact) equal to v bit for bit, or
    None if some block has none. m is the block's minimum (Q4_1 maps it to q = 0); d is tried
    at the float16 nearest ``(max - min) / 15`` and its two neighbours."""
    m = v.amin(1)
    d0 = ((v.amax(1) - m) / 15).half()
    d_out = torch.zeros_like(m)
    q_out = torch.zeros(v.shape, dtype=torch.uint8)
    todo = None  # indices of the blocks without codes yet (None: all); each block is its own
    for step in (0, 1, -1):  # computation, so trying the neighbours on the rest alone is exact
        vv, mm, dd = (v, m, d0) if todo is None else (v[todo], m[todo], d0[todo])
        d = (dd.view(torch.int16) + step).view(torch.float16).float() if step else dd.float()
        d = torch.where(torch.isfinite(d) & (d >= 0), d, torch.zeros_like(d))
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = ((vv - mm[:, None]) / safe[:, None]).round_().clamp_(0, 15)
        q = torch.where(d[:, None] > 0, q, torch.zeros_like(q))
        rec = d[:, None] * q + mm[:, None]  # two ops: the product is exact, so one rounding
        ok = (rec.view(torch.int32) == vv.view(torch.int32)).all(1)
        where = ok.nonzero()[:, 0] if todo is None else todo[ok]
        d_out[where] = d[ok]
        q_out[where] = q[ok].to(torch.uint8)
        todo = (~ok).nonzero()[:, 0] if todo is None else todo[~ok]
        if not todo.numel():
            return d_out, m, q_out
    return None


def pack_quantized(weight: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """``weight`` ``[N, K]`` float32 as exact codes in the kernel's layout (``csrc/linear_f32.c``,
    ``sb_linear_quant``): (kind, scales, codes), Q8_0 tried first (it has no offset), then Q4_1;
    None where K is not a multiple of 32 or some block of 32 is not exactly representable
    (any ordinary float32 weight). Every block is checked bit for bit. Not cached: see
    ``packed``. ~0.2 s per 10M weights on 2 cores."""
    n, k = weight.shape
    if k % BLOCK or n == 0 or weight.dtype != torch.float32:
        return None
    w = weight.detach().contiguous()
    v = w.reshape(-1, BLOCK)
    panels, nblk = -(-n // NR), k // BLOCK
    # every block must have codes: the first row's blocks settle an ordinary float32 weight
    # (a random init, a bfloat16 checkpoint) at once, instead of after trying all of them
    if _q8_0_codes(v[:nblk]) is None and _q4_1_codes(v[:nblk]) is None:
        return None
    found = _q8_0_codes(v)
    if found is not None:
        d, q = found
        scales = torch.zeros(panels * NR, nblk, dtype=torch.float32)
        scales[:n] = d.view(n, nblk)
        codes = torch.zeros(panels * NR, nblk, BLOCK, dtype=torch.int8)
        codes[:n] = q.view(n, nblk, BLOCK)
        return (Q8_0, scales.view(panels, NR, nblk).transpose(1, 2).contiguous(),
                codes.view(panels, NR, nblk, BLOCK).transpose(1, 2).contiguous().view(torch.uint8))
    found = _q4_1_codes(v)
    if found is None:
        return None
    d, m, q = found
    scales = torch.zeros(panels * NR, nblk, 2, dtype=torch.float32)
    scales[:n] = torch.stack([d, m], dim=1).view(n, nblk, 2)
    q = q.view(n, nblk, 4, 8)  # the four runs of 8 k; byte i of a half: run 2h low, 2h+1 high
    nibbles = torch.cat([q[:, :, 0] | (q[:, :, 1] << 4), q[:, :, 2] | (q[:, :, 3] << 4)], dim=2)
    codes = torch.zeros(panels * NR, nblk, 16, dtype=torch.uint8)
    codes[:n] = nibbles
    return (Q4_1, scales.view(panels, NR, nblk, 2).transpose(1, 2).contiguous(),
            codes.view(panels, NR, nblk, 16).transpose(1, 2).contiguous())


GROUP = 16  # output columns per group in linear_q8.c's layout


def _by_group(t: torch.Tensor, n: int, nblk: int, *tail: int) -> torch.Tensor:
    """[n, nblk, *tail] -> zero-padded [G, nblk, 16, *tail] (a view)"""
    groups = -(-n // GROUP)
    out = t.new_zeros(groups * GROUP, nblk, *tail)
    out[:n] = t
    return out.view(groups, GROUP, nblk, *tail).transpose(1, 2)


def _q8_x8(d: torch.Tensor, q: torch.Tensor, n: int, nblk: int) -> torch.Tensor:
    """int8 codes q ``[n, K]`` -> ``[G, K / 32, 8, 16, 4]`` uint8 (q + 128); d passes through"""
    q = _by_group((q.to(torch.int16) + 128).to(torch.uint8).view(n, nblk, 8, 4), n, nblk, 8, 4)
    return q.permute(0, 1, 3, 2, 4).contiguous()  # [G, nblk, r, c, j]


def _q4_1_x8(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor, n: int, nblk: int) -> tuple:
    codes = _nibbles(q, n, nblk)  # [G, nb, r, c, j]
    scales = torch.stack([_by_group(d.reshape(n, nblk), n, nblk),
                          _by_group(m.reshape(n, nblk), n, nblk)], dim=2)
    return Q4_1_X8, scales.contiguous(), codes


def _nibbles(q: torch.Tensor, n: int, nblk: int) -> torch.Tensor:
    """codes ``[n, K]`` in 0..15 -> ``[G, K / 32, 4, 16, 4]`` uint8: byte (r, c, j) = q(c, 4r +
    j) | q(c, 16 + 4r + j) << 4 (Q4_1's layout)"""
    q = _by_group(q.reshape(n, nblk, 2, 4, 4), n, nblk, 2, 4, 4).permute(0, 1, 3, 4, 2, 5)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous()


def _file_x8(kind: str, form: tuple, n: int, nblk: int) -> tuple:
    """n rows of a ``kquant`` ``*_codes`` form (``GGUFCodes.find`` / ``named``) in the layout
    of ``pack_q8``: Q4_K and Q6_K as their own kinds, which keep the GGUF's scale parts
    (float16 per super-block of 256 k, small integers per block) and multiply them back in the
    kernel (exact products: 4.6 and 6.6 bits a weight instead of 6 and 10 with a float32 scale
    per block of 32 or 16 k and 8-bit Q6_K codes); Q4_1 as Q4_1 blocks, Q5_K and Q5_1 as the
    Q5_K kind, Q5_0 and Q8_0 as Q8_0 blocks (Q5_0's codes q - 16)."""
    groups, nsb = -(-n // GROUP), nblk // 8
    if kind == "Q4_K":  # codes [G, nblk, 288]: Q4_1's 256 nibble bytes, sc [16], m [16]
        _, _, q, d16, dmin16, sc, mn = form
        codes = torch.cat([_nibbles(q, n, nblk).view(groups, nblk, 256),
                           _by_group(sc, n, nblk), _by_group(mn, n, nblk)], dim=2)
        # scales [G, K / 256, 2, 16] float16: d, then dmin, per column
        scales = torch.stack([_by_group(d16, n, nsb), _by_group(dmin16, n, nsb)], dim=2)
        return Q4_K_X8, scales.contiguous(), codes.contiguous()
    if kind == "Q4_1":
        return _q4_1_x8(*form, n, nblk)
    if kind in ("Q5_K", "Q5_1"):
        d, m, q = form
        scales = torch.stack([_by_group(d, n, nblk), _by_group(m, n, nblk)], dim=2)
        return Q5_K_X8, scales.contiguous(), _q8_x8(d, q.to(torch.int8), n, nblk)
    if kind in ("Q5_0", "Q8_0"):
        d, q = form
        return Q8_0_X8, _by_group(d.reshape(n, nblk), n, nblk).contiguous(), _q8_x8(d, q, n, nblk)
    # Q6_K: codes [G, nblk, 416]: the low 4 bits of q + 32 as Q4_1's nibbles (256 bytes), the
    # high 2 bits (128 bytes: byte (s, c, j) holds k 8t + 4s + j at bits 2t, t = 0..3), sc of
    # k 0..15 [16] and of k 16..31 [16] (int8); scales [G, K / 256, 16] float16 d per column
    _, q, d16, sc = form
    u = (q.to(torch.int16) + 32).to(torch.uint8)  # 0..63
    high = _by_group((u >> 4).reshape(n, nblk, 4, 2, 4), n, nblk, 4, 2, 4)  # [G, nb, c, t, s, j]
    high = high.permute(0, 1, 3, 4, 2, 5)  # [G, nb, t, s, c, j]
    high = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    scs = _by_group(sc.view(torch.uint8).reshape(n, nblk, 2), n, nblk, 2).transpose(2, 3)
    codes = torch.cat([_nibbles(u & 15, n, nblk).view(groups, nblk, 256),
                       high.reshape(groups, nblk, 128), scs.reshape(groups, nblk, 32)], dim=2)
    return Q6_K_X8, _by_group(d16, n, nsb).contiguous(), codes.contiguous()


def pack_runs(runs: list[tuple[int, int, str, tuple]], k: int) -> tuple:
    """``kquant.GGUFCodes.find`` / ``named``'s runs of a weight ``[N, K = k]`` in ``pack_q8``'s
    form: one run's kind, or ``(SEGMENTS, table, empty, parts)`` for several."""
    nblk = k // BLOCK
    parts = [_file_x8(kind, form, r1 - r0, nblk) for r0, r1, kind, form in runs]
    if len(parts) == 1:
        return parts[0]
    table = torch.tensor([[p[0], p[1].data_ptr(), p[2].data_ptr(), r0, r1 - r0]
                          for p, (r0, r1, _, _) in zip(parts, runs)], dtype=torch.int64)
    return SEGMENTS, table, torch.empty(0, dtype=torch.uint8), parts


def pack_q8(weight: torch.Tensor, source=None) -> tuple | None:
    """``weight`` ``[N, K]`` float32 as exact codes in the 8-bit-activation kernel's layout
    (``csrc/linear_q8.c``): (``Q4_1_X8``, ``Q8_0_X8``, ``Q4_K_X8``, ``Q5_K_X8`` or
    ``Q6_K_X8``, scales, codes), None where it has no exact codes (as ``pack_quantized``).
    Columns in groups of 16 (zero weights past N): Q4_1 codes ``[G, K / 32, 4, 16, 4]`` uint8
    (k 4r..4r+3 in the low nibble, 16 + 4r.. in the high one), scales ``[G, K / 32, 2, 16]``
    (d, m); Q8_0 codes ``[G, K / 32, 8, 16, 4]`` uint8 (q + 128), scales ``[G, K / 32, 16]``;
    Q5_K codes as Q8_0's, scales as Q4_1's; Q4_K and Q6_K as ``_file_x8`` writes them
    (float16 scales per 256 k, ``[G, K / 256, 2, 16]`` and ``[G, K / 256, 16]``; codes ``[G,
    K / 32, 288]`` and ``[G, K / 32, 416]`` uint8 with the blocks' integer scales).

    source: a ``kquant.GGUFCodes`` whose Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 rows are tried first
    (``_file_x8``). Rows of several kinds give ``(SEGMENTS, table, empty, parts)``: table
    ``[runs, 5]`` int64 (kind, scales pointer, codes pointer, first row, rows), parts the runs'
    forms, which it points into (``pack_runs``)."""
    n, k = weight.shape
    if k % BLOCK or n == 0 or weight.dtype != torch.float32:
        return None
    nblk = k // BLOCK
    runs = None if source is None else source.find(weight)  # first: a miss costs one row's key
    if runs is not None:
        return pack_runs(runs, k)
    v = weight.detach().contiguous().reshape(-1, BLOCK)
    # the first row's blocks settle which kind to try on all of them (a Q4_1 weight used to
    # run the whole Q8_0 search first: 12 s of SmolLM2's int8 load at a load of 9)
    found = _q8_0_codes(v) if _q8_0_codes(v[:nblk]) is not None else None
    if found is not None:
        d, q = found
        return Q8_0_X8, _by_group(d.view(n, nblk), n, nblk).contiguous(), _q8_x8(d, q, n, nblk)
    found = _q4_1_codes(v)
    return None if found is None else _q4_1_x8(*found, n, nblk)


def set_int8_form(weight: torch.Tensor, form: tuple) -> None:
    """Mark ``weight`` ``[N, K]`` for 8-bit activations with ``form`` (``pack_runs``' result,
    made from the GGUF's codes by name: ``kquant.GGUFCodes.named``) as its kernel form, its
    float32 values not read (the weight may already be released: ``models.dense``)."""
    _INT8[weight] = True
    _PACKED[weight] = ((weight._version, True), form)


# weights whose matmuls take 8-bit activations (``use_int8_activations``)
_INT8 = WeakIdKeyDictionary()


def use_int8_activations(weight: torch.Tensor, source=None) -> bool:
    """From now on ``linear(x, weight)`` rounds x to 8 bits per block of 32 and runs integer
    dot products on the weight's exact codes (``csrc/linear_q8.c``; the dtype ``int8``).
    source: a ``kquant.GGUFCodes`` of the GGUF the weight came from, for K-quant codes.
    Returns whether the weight has such codes: one without them keeps the float32 panels.
    The source is not kept: a weight changed in place no longer has the file's codes anyway
    (``kquant.GGUFCodes.find`` checks every bit), and the source holds an index of every row
    of the file (~100 MB of Python objects for the 1.5B Qwen)."""
    _INT8[weight] = source if source is not None else True
    form = packed(weight)
    _INT8[weight] = True
    return form[0] in INT8_KINDS


INT8_KERNELS = ("portable", "avx2", "vnni")  # csrc/linear_q8.c's kernels, slowest first


def int8_kernel(name: str | None = None) -> str | None:
    """Which kernel runs the 8-bit-activation matmuls: ``"vnni"`` (AVX-512 VNNI, where the CPU
    has it), ``"avx2"`` (``SPECBATCH_CPU_VNNI=0`` starts there) or ``"portable"`` (plain C, for
    tests); None without the C kernels. All give the same bits. ``name`` switches first
    (``"vnni"`` falls back to ``"avx2"`` on a CPU without it)."""
    lib = _library()
    if lib is None:
        return None
    return INT8_KERNELS[lib.sb_linear_q8_isa(-1 if name is None else INT8_KERNELS.index(name))]


def _quantized_weights() -> bool:
    return settings.cpu_code_weights()


def packed(weight: torch.Tensor) -> tuple:
    """The kernel's form of ``weight``: ``(Q4_1 or Q8_0, scales, codes)`` where it is exactly
    representable (``pack_quantized``; ``pack_q8``'s form for a weight marked by
    ``use_int8_activations``), else ``(0, pack_weight(weight))``.
    Cached per weight until it changes in place (``_version``)."""
    mark = _INT8.get(weight)
    int8 = mark is not None
    entry = _PACKED.get(weight)
    if entry is not None and entry[0] == (weight._version, int8):
        return entry[1]
    form = None
    if released(weight):
        raise RuntimeError(f"weight {tuple(weight.shape)}: its values were released once its "
                           f"kernel form was made (dtype int8), and the form is gone or stale")
    if _quantized_weights():
        form = (pack_q8(weight, None if mark is True else mark) if int8
                else pack_quantized(weight))
    if form is None:
        form = (0, pack_weight(weight))
    _PACKED[weight] = ((weight._version, int8), form)
    return form


def form_bytes(weight: torch.Tensor) -> int:
    """Bytes of the kernel form ``packed`` holds for ``weight`` (codes, scales, float32 panels;
    a segmented weight's runs), 0 where none is cached."""
    entry = _PACKED.get(weight)
    if entry is None:
        return 0
    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        elif isinstance(t, (tuple, list)):
            for item in t:
                add(item)

    add(entry[1][1:])
    return sum(seen.values())


def _checked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """x as ``[M, K]`` with unit column stride, N, K, x's leading shape, bias contiguous."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"float32 CPU tensors only, got x {x.dtype} on {x.device}, "
                         f"weight {weight.dtype}")
    n, k = weight.shape
    if x.shape[-1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)} do not match")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # a view where it can be (a row-broadcast x keeps row stride 0)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, n, k, lead, None if bias is None else bias.detach().contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with rows that do not depend on the row count.

    x: ``[..., K]`` float32 CPU; weight: ``[N, K]`` float32; bias: ``[N]`` float32 or None.
    Returns ``[..., N]`` float32. Raises ``RuntimeError`` if the kernel is not ``available()``,
    ``ValueError`` on a dtype, device or shape it does not take.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the float32 CPU matmul kernel is not available here")
    x2, n, k, lead, bias = _checked(x, weight, bias)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        form = packed(weight)
        b_ptr = None if bias is None else bias.data_ptr()
        if form[0]:
            if lib.sb_linear_quant(x2.data_ptr(), x2.stride(0), form[0], form[1].data_ptr(),
                                   form[2].data_ptr(), b_ptr, y.data_ptr(), n, m, n, k):
                raise MemoryError("the quantised matmul could not allocate its buffer")
        else:
            lib.sb_linear_f32(x2.data_ptr(), x2.stride(0), form[1].data_ptr(), b_ptr,
                              y.data_ptr(), n, m, n, k)
    return y.view(*lead, n)

