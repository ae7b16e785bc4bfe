"""GGUF weights as codes for the 8-bit-activation matmul (int8): Q4_K, Q5_K, Q6_K, Q5_0, Q5_1
(and Q4_1, Q8_0), read from the file.

The engine's weights are float32 tensors that transformers dequantised from the GGUF with the
``gguf`` package. A Q4_1 / Q8_0 weight gives its codes back from those floats alone
(``linear_cpu.pack_q8``); a K-quant one does not (its sub-block scales are products of a
float16 and a 6- or 8-bit integer), so its codes are read from the GGUF file itself
(``GGUFCodes``) and matched to the float32 rows by value: a row is taken only if the codes
dequantise to its float32 bits exactly, whatever transformers did to the tensor on the way
(renamed it, permuted its rows, fused it with others).

A super-block of 256 k (llama.cpp's ``block_q4_K`` / ``block_q6_K``, ggml-common.h) becomes
the kernel's blocks of 32 (``csrc/linear_q8.c``):

- Q4_K: float16 d, dmin; eight sub-blocks of 32 with 6-bit scale sc and min m, 4-bit q.
  gguf dequantises w = (d sc) q - (dmin m) in float32, d sc and dmin m exact, (d sc) q exact:
  one rounding. That is a Q4_1 block of the kernel with d_w = d sc, m_w = -(dmin m); the
  kernel's Q4_K kind keeps d, dmin (float16) and sc, m (uint8) and multiplies them itself.
- Q5_K: as Q4_K with 5-bit q: the kernel's Q5_K kind (Q4_1's arithmetic on 8-bit codes).
- Q6_K: float16 d; sixteen sub-blocks of 16 with int8 scale sc, 6-bit q; w = (d sc)(q - 32).
  A block of 32 is two sub-blocks: the kernel's Q6_K kind, codes q (6 bits, stored as q + 32),
  scales d sc per 16 (d and sc kept apart, multiplied in the kernel).

A block of 32 of the legacy kinds (``block_q5_0`` / ``block_q5_1`` / ``block_q4_1`` /
``block_q8_0``, ggml-common.h) is a kernel block as it stands:

- Q5_0: float16 d, 5-bit q; gguf dequantises w = d (q - 16): the kernel's Q8_0 kind with codes
  q - 16 in -16..15 (8 bits a code in memory: the integer sums are the same numbers).
- Q5_1: float16 d, m, 5-bit q; w = d q + m: the kernel's Q5_K kind.
- Q4_1 / Q8_0: the kernel's Q4_1 / Q8_0 kinds (their floats alone give the same codes:
  ``linear_cpu.pack_q8``; by name, ``GGUFCodes.named``, they need not be read).

The kernel then sums exact integer products per sub-block and applies each scale with float32
operations that are one output element's own, in block order: the invariance argument of the
Q4_1 / Q8_0 kinds (docs/design.md), unchanged.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch

QK_K = 256  # k per super-block
Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = 144, 176, 210  # bytes per super-block (ggml-common.h)
QK = 32  # k per block of the legacy kinds
Q5_0_BYTES, Q5_1_BYTES, Q4_1_BYTES, Q8_0_BYTES = 22, 24, 20, 34  # bytes per block of 32
_KEY_K = 16  # values of a row's start that key it


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian float16 -> [...] float32"""
    return raw.contiguous().view(torch.float16)[..., 0].float()


def _scales_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K / Q5_K super-blocks ``[R, nb, bytes]`` -> (d sc, -(dmin m)) ``[R, nb, 8]`` float32,
    then their parts: d, dmin ``[R, nb]`` float16, sc, m ``[R, nb, 8]`` uint8 (6 bits)"""
    r, nb = blocks.shape[:2]
    d16 = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    dmin16 = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    d, dmin = d16.float(), dmin16.float()
    s = blocks[..., 4:16].to(torch.int32).view(r, nb, 3, 4)
    # the 12 scale bytes: sc and m of sub-blocks 0..3 in the low 6 bits of bytes 0..3 / 4..7;
    # of 4..7 in the nibbles of bytes 8..11 (low: sc, high: m) with 2 high bits from 0..3 / 4..7
    lo, hi, mix = s[:, :, 0], s[:, :, 1], s[:, :, 2]
    sc = torch.cat([lo & 63, (mix & 15) | ((lo >> 2) & 48)], dim=-1)  # [R, nb, 8]
    mn = torch.cat([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], dim=-1)
    dw = d[..., None] * sc.float()  # exact: 11 significant bits times 6
    return (dw, -(dmin[..., None] * mn.float()), d16, dmin16, sc.to(torch.uint8),
            mn.to(torch.uint8))


def q4_k_codes(raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K rows ``raw`` ``[R, K / 256 * 144]`` uint8 -> (d ``[R, K / 32]`` float32, m ``[R, K /
    32]`` float32, q ``[R, K]`` uint8 in 0..15) with w = d q + m per block of 32 (m <= 0), then
    the parts d and m are made of: the super-blocks' float16 d, dmin ``[R, K / 256]`` and the
    blocks' 6-bit sc, m ``[R, K / 32]`` uint8 (d = d sc, m = -(dmin m), both products exact)."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, Q4_K_BYTES)
    nb = blocks.shape[1]
    dw, mw, d16, dmin16, sc, mn = _scales_mins(blocks)
    qs = blocks[..., 16:].view(r, nb, 4, 1, 32)  # 4 runs of 32 bytes: sub-blocks 2i (low), 2i+1
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(r, nb * QK_K)
    return (dw.reshape(r, -1), mw.reshape(r, -1), q, d16, dmin16, sc.reshape(r, -1),
            mn.reshape(r, -1))


def q5_k_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K rows ``raw`` ``[R, K / 256 * 176]`` uint8 -> (d, m, q) as ``q4_k_codes``'s first
    three, q in 0..31 (the fifth bit of sub-block j's k t is bit j of byte t of the 32 ``qh``
    bytes)."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, Q5_K_BYTES)
    nb = blocks.shape[1]
    dw, mw = _scales_mins(blocks)[:2]
    qh = blocks[..., 16:48].view(r, nb, 1, 32)
    qh = torch.cat([(qh >> j) & 1 for j in range(8)], dim=2)  # [R, nb, 8, 32]
    qs = blocks[..., 48:].view(r, nb, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=3).view(r, nb, 8, 32) | (qh << 4)
    return dw.reshape(r, -1), mw.reshape(r, -1), q.reshape(r, nb * QK_K)


def q6_k_codes(raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q6_K rows ``raw`` ``[R, K / 256 * 210]`` uint8 -> (d ``[R, K / 16]`` float32, q ``[R,
    K]`` int8 in -32..31) with w = d q per sub-block of 16, then the parts of d: the
    super-blocks' float16 d ``[R, K / 256]`` and the sub-blocks' int8 sc ``[R, K / 16]`` (d =
    d sc, exact)."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, Q6_K_BYTES)
    nb = blocks.shape[1]
    ql = blocks[..., :128].view(r, nb, 2, 1, 64)  # per half of 128 k: 64 bytes, two nibbles
    ql = torch.cat([ql & 15, ql >> 4], dim=3).reshape(r, nb, 2, 128)
    qh = blocks[..., 128:192].view(r, nb, 2, 1, 32)  # per half: 32 bytes, four 2-bit fields
    qh = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(r, nb, 2, 128)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).to(torch.int8).reshape(r, nb * QK_K)
    sc = blocks[..., 192:208].contiguous().view(torch.int8)  # [R, nb, 16]
    d16 = blocks[..., 208:210].contiguous().view(torch.float16)[..., 0]
    dw = d16.float()[..., None] * sc.float()  # exact: 11 significant bits times 8
    return dw.reshape(r, -1), q, d16, sc.reshape(r, -1)


def _five_bits(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    """Q5_0 / Q5_1 blocks ``[R, nb, bytes]`` -> q ``[R, nb, 32]`` uint8 in 0..31: k j < 16 the
    low nibble of byte j of the 16 ``qs`` bytes (after ``qh``), k 16 + j the high one; the
    fifth bit of k t is bit t of the little-endian 32-bit ``qh`` at byte ``qh_at``."""
    qh = blocks[..., qh_at:qh_at + 4].to(torch.int64)
    qh = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)  # [R, nb]
    high = ((qh[..., None] >> torch.arange(32)) & 1).to(torch.uint8)  # [R, nb, 32]
    qs = blocks[..., qh_at + 4:qh_at + 20]
    return torch.cat([qs & 15, qs >> 4], dim=-1) | (high << 4)


def q5_0_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 rows ``raw`` ``[R, K / 32 * 22]`` uint8 -> (d ``[R, K / 32]`` float32, q ``[R, K]``
    int8 in -16..15) with w = d q per block of 32."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, Q5_0_BYTES)
    q = (_five_bits(blocks, 2).to(torch.int16) - 16).to(torch.int8)
    return _f16(blocks[..., 0:2]), q.reshape(r, -1)


def q5_1_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_1 rows ``raw`` ``[R, K / 32 * 24]`` uint8 -> (d, m ``[R, K / 32]`` float32, q ``[R,
    K]`` uint8 in 0..31) with w = d q + m per block of 32."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, Q5_1_BYTES)
    return _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]), _five_bits(blocks, 4).reshape(r, -1)


def q4_1_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows ``raw`` ``[R, K / 32 * 20]`` uint8 -> (d, m ``[R, K / 32]`` float32, q ``[R,
    K]`` uint8 in 0..15) with w = d q + m per block of 32 (k j < 16 low nibbles, 16 + j high)."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, Q4_1_BYTES)
    qs = blocks[..., 4:20]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)
    return _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]), q.reshape(r, -1)


def q8_0_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows ``raw`` ``[R, K / 32 * 34]`` uint8 -> (d ``[R, K / 32]`` float32, q ``[R, K]``
    int8) with w = d q per block of 32."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, Q8_0_BYTES)
    return _f16(blocks[..., 0:2]), blocks[..., 2:].contiguous().view(torch.int8).reshape(r, -1)


# kinds whose form is (d, m, q) with w = d q + m per block of 32; the others' is (d, q) with
# w = d q per block of 32, Q6_K's per 16
OFFSET_KINDS = ("Q4_K", "Q5_K", "Q5_1", "Q4_1")


def dequantize(kind: str, form: tuple) -> torch.Tensor:
    """The float32 weights ``[R, K]`` of a ``*_codes`` form (its first 3 or 2 tensors: Q4_K's
    and Q6_K's also hold their scales' parts), computed as the ``gguf`` package computes them
    (so equal bit for bit to what transformers loaded)."""
    if kind in OFFSET_KINDS:
        d, m, q = form[:3]
        r = q.shape[0]
        return (d[..., None] * q.view(r, -1, 32).float() + m[..., None]).view(r, -1)
    d, q = form[:2]
    r = q.shape[0]
    return (d[..., None] * q.view(r, d.shape[1], -1).float()).view(r, -1)


# kind -> (decoder, bytes per block, k per block)
_DECODE = {"Q4_K": (q4_k_codes, Q4_K_BYTES, QK_K), "Q5_K": (q5_k_codes, Q5_K_BYTES, QK_K),
           "Q6_K": (q6_k_codes, Q6_K_BYTES, QK_K), "Q5_0": (q5_0_codes, Q5_0_BYTES, QK),
           "Q5_1": (q5_1_codes, Q5_1_BYTES, QK), "Q4_1": (q4_1_codes, Q4_1_BYTES, QK),
           "Q8_0": (q8_0_codes, Q8_0_BYTES, QK)}
# the kinds ``find`` matches by value (Q4_1 / Q8_0 weights give their codes from their floats)
VALUE_KINDS = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")
_MULT = np.random.default_rng(35).integers(1, 1 << 62, _KEY_K + 1, dtype=np.uint64) | np.uint64(1)


def _keys(rows: torch.Tensor, k: int) -> list[int]:
    """float32 ``[R, >= 16]`` -> a 64-bit key per row of length k: a hash of k and its first 16
    values' bits (equal rows, equal keys; a collision only costs a failed check)."""
    bits = rows[:, :_KEY_K].contiguous().view(torch.int32).numpy().view(np.uint32)
    h = (bits.astype(np.uint64) * _MULT[:_KEY_K]).sum(1, dtype=np.uint64)  # wraps mod 2^64
    return (h ^ np.uint64(k * int(_MULT[_KEY_K]) % (1 << 64))).tolist()


def _first_values(kind: str, raw: np.ndarray) -> torch.Tensor:
    """The first 16 float32 values ``[R, 16]`` of each row of ``raw`` (its first super-block's
    first sub-block, or its first block; the ``gguf`` package's arithmetic, as ``dequantize``):
    the index's keys without dequantising whole super-blocks."""
    b = torch.from_numpy(np.array(raw[:, :_DECODE[kind][1]]))
    if kind == "Q6_K":
        q = (b[:, :16] & 15) | ((b[:, 128:144] & 3) << 4)
        d = _f16(b[:, 208:210]) * b[:, 192:193].view(torch.int8)[:, 0].float()
        return d[:, None] * (q.to(torch.int16) - 32).float()
    if _DECODE[kind][2] == QK:  # a block of 32: decode it whole
        return dequantize(kind, _DECODE[kind][0](b))[:, :_KEY_K]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = (b[:, 4] & 63).float(), (b[:, 8] & 63).float()
    q = b[:, 16:32] & 15 if kind == "Q4_K" else (b[:, 48:64] & 15) | ((b[:, 16:32] & 1) << 4)
    return (d * sc)[:, None] * q.float() - (dmin * mn)[:, None]


def _code_tensors(path: str | Path) -> tuple[mmap.mmap, list[tuple[str, str, int, int, int]]]:
    """The file mapped, and its tensors of the kinds of ``_DECODE`` as (name, kind, byte
    offset, rows, bytes per row), from the GGUF header (``models.gguf_header.tensor_table``:
    v2 / v3, the metadata's values skipped; the ``gguf`` package's reader spends ~20 s on a
    150k-token vocabulary)."""
    from specbatch.models.gguf_header import tensor_table

    table = tensor_table(path)
    with open(path, "rb") as handle:
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    tensors = []
    for name, kind, dims, offset in table:
        if kind in _DECODE and dims[0] % _DECODE[kind][2] == 0:
            rows = int(np.prod(dims[1:], dtype=np.int64))
            tensors.append((name, kind, offset, rows,
                            dims[0] // _DECODE[kind][2] * _DECODE[kind][1]))
    return data, tensors


def _cat_forms(forms: list[tuple]) -> tuple:
    return forms[0] if len(forms) == 1 else tuple(torch.cat(parts) for parts in zip(*forms))


class GGUFCodes:
    """The code tensors of a GGUF file (``_DECODE``'s kinds), by name or by float32 values.

    ``named`` gives the codes of tensors named as in the file (``blk.3.attn_q.weight``): what
    the engine's int8 load uses (``backends.cpu.Int8Weights``), reading only the codes it
    takes. ``find`` matches a float32 weight's rows by value instead, for a weight whose names
    are not known: its first call indexes every Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 row by its
    first 16 values (4 s for the 949k rows of Qwen2.5-Coder-1.5B Q4_K_M on 2 busy cores, 17 s
    at a load of 10). Raises ``ValueError`` for a file that is not GGUF v2 / v3.
    """

    def __init__(self, path: str | Path) -> None:
        self._file, found = _code_tensors(path)
        self._tensors: list[tuple[str, np.ndarray]] = []
        self._names: dict[str, int] = {}
        self._index: dict[int, list[tuple[int, int]]] | None = None  # built by the first find
        for name, kind, offset, rows, row_bytes in found:
            raw = np.frombuffer(self._file, np.uint8, rows * row_bytes, offset).reshape(rows, -1)
            self._names[name] = len(self._tensors)
            self._tensors.append((kind, raw))

    def __len__(self) -> int:
        """Rows of the tensors ``find`` matches (Q4_1 / Q8_0 ones not counted)."""
        return sum(raw.shape[0] for kind, raw in self._tensors if kind in VALUE_KINDS)

    def has_codes(self) -> bool:
        """Whether the file has any tensor of the kinds of ``_DECODE``."""
        return bool(self._tensors)

    def kind(self, name: str) -> str | None:
        """The kind of the file's tensor ``name``, None where it has no codes the kernels take
        (an F32 / F16 / Q4_0 tensor) or no such tensor."""
        i = self._names.get(name)
        return None if i is None else self._tensors[i][0]

    def named(self, names, orders=None, probes=None) -> list[tuple[int, int, str, tuple]] | None:
        """The file's tensors ``names`` (each ``[N_i, K]``) stacked in that order as ``find``'s
        runs, or None where one has no codes (``kind``) or their K differ.

        orders: per name None or an int64 ``[N_i]`` tensor, the file row of each row (a
        permutation: transformers un-permutes llama's q / k heads). probes: per name None or
        the float32 ``[N_i, K]`` weight that should hold these codes' values; rows 0, 1, N_i /
        3, N_i / 2 and N_i - 1 are checked bit for bit against it (a wrong name or order: None;
        five rows read of each, so a weight memory-mapped from a file is barely touched)."""
        parts, k = [], None
        for j, name in enumerate(names):
            kind = self.kind(name)
            if kind is None:
                return None
            raw = self._tensors[self._names[name]][1]
            row_k = raw.shape[1] // _DECODE[kind][1] * _DECODE[kind][2]
            if k not in (None, row_k):
                return None
            k = row_k
            order = None if orders is None else orders[j]
            probe = None if probes is None else probes[j]
            n = raw.shape[0]
            if probe is not None:
                if tuple(probe.shape) != (n, k):
                    return None
                rows = torch.tensor(sorted({0, min(1, n - 1), n // 3, n // 2, n - 1}))
                at = rows if order is None else order[rows]
                form = _DECODE[kind][0](torch.from_numpy(raw[at.numpy()]))
                if not torch.equal(dequantize(kind, form).view(torch.int32),
                                   probe.detach()[rows].contiguous().view(torch.int32)):
                    return None
            rows_raw = np.array(raw) if order is None else raw[order.numpy()]  # (a copy)
            parts.append((n, kind, _DECODE[kind][0](torch.from_numpy(rows_raw))))
        runs, start = [], 0
        for n, kind, form in parts:
            if runs and runs[-1][2] == kind:
                runs[-1][1] = start + n
                runs[-1][3].append(form)
            else:
                runs.append([start, start + n, kind, [form]])
            start += n
        return [(r0, r1, kind, _cat_forms(forms)) for r0, r1, kind, forms in runs]

    def _rows_index(self) -> dict[int, list[tuple[int, int]]]:
        """key -> the (tensor, row) pairs of that key; built once, at the first ``find`` (a
        forward whose weights are already packed never pays for it)."""
        if self._index is None:
            index: dict[int, list[tuple[int, int]]] = {}
            for i, (kind, raw) in enumerate(self._tensors):
                if kind not in VALUE_KINDS:
                    continue
                keys = _keys(_first_values(kind, raw),
                             raw.shape[1] // _DECODE[kind][1] * _DECODE[kind][2])
                for row, key in enumerate(keys):
                    index.setdefault(key, []).append((i, row))
            self._index = index
        return self._index

    def find(self, weight: torch.Tensor) -> list[tuple[int, int, str, tuple]] | None:
        """``weight`` ``[N, K]`` float32 as runs ``(row0, row1, kind, form)`` in row order (kind
        one of ``VALUE_KINDS``; form: that kind's ``*_codes`` of rows row0..row1-1), or None
        unless every row is such a row of the file whose codes give its bits exactly."""
        n, k = weight.shape
        if k % QK or n == 0 or weight.dtype != torch.float32:
            return None
        w = weight.detach()
        index = self._rows_index()
        if _keys(w[:1], k)[0] not in index:  # the usual miss (a Q8_0 / F32 tensor): cheap
            return None
        picks = []  # per row: its (tensor, row) candidates
        for key in _keys(w, k):
            found = index.get(key)
            if not found:
                return None
            picks.append(found)
        runs, start = [], 0
        while start < n:
            for t, r0 in picks[start]:  # a run: consecutive rows of one tensor
                end = start + 1
                while end < n and (t, r0 + end - start) in picks[end]:
                    end += 1
                kind, raw = self._tensors[t]
                form = self._checked(kind, raw[r0:r0 + end - start], w[start:end])
                if form is not None:
                    break
            else:
                return None
            if runs and runs[-1][2] == kind:  # the same kind continues: one run (rows that
                runs[-1][1] = end             # a permutation interleaved: many pieces)
                runs[-1][3].append(form)
            else:
                runs.append([start, end, kind, [form]])
            start = end
        return [(r0, r1, kind, _cat_forms(forms)) for r0, r1, kind, forms in runs]

    @staticmethod
    def _checked(kind: str, raw: np.ndarray, rows: torch.Tensor, chunk: int = 4096):
        """The codes of ``raw`` if they dequantise to ``rows``' bits exactly, else None."""
        forms = []
        for i in range(0, rows.shape[0], chunk):
            form = _DECODE[kind][0](torch.from_numpy(np.array(raw[i:i + chunk])))
            if not torch.equal(dequantize(kind, form).view(torch.int32),
                               rows[i:i + chunk].view(torch.int32)):
                return None
            forms.append(form)
        return _cat_forms(forms)
