"""GGUF K-quant weights (Q4_K, Q5_K, Q6_K) as codes for the 8-bit-activation matmul (int8).

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
  one rounding. That is a Q4_1 block of the kernel with d_w = d sc, m_w = -(dmin m).
- Q5_K: as Q4_K with 5-bit q: the kernel's Q5_K kind (Q4_1's arithmetic on 8-bit codes).
- Q6_K: float16 d; sixteen sub-blocks of 16 with int8 scale sc, 6-bit q; w = (d sc)(q - 32).
  A block of 32 is two sub-blocks: the kernel's Q6_K kind, codes q - 32, scales d sc per 16.

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
_KEY_K = 16  # values of a row's start that key it


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian float16 -> [...] float32"""
    return raw.contiguous().view(torch.float16)[..., 0].float()


def _scales_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K super-blocks ``[R, nb, bytes]`` -> (d sc, -(dmin m)) ``[R, nb, 8]`` float32"""
    r, nb = blocks.shape[:2]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    s = blocks[..., 4:16].to(torch.int32).view(r, nb, 3, 4)
    # the 12 scale bytes: sc and m of sub-blocks 0..3 in the low 6 bits of bytes 0..3 / 4..7;
    # of 4..7 in the nibbles of bytes 8..11 (low: sc, high: m) with 2 high bits from 0..3 / 4..7
    lo, hi, mix = s[:, :, 0], s[:, :, 1], s[:, :, 2]
    sc = torch.cat([lo & 63, (mix & 15) | ((lo >> 2) & 48)], dim=-1)  # [R, nb, 8]
    mn = torch.cat([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], dim=-1)
    dw = d[..., None] * sc.float()  # exact: 11 significant bits times 6
    return dw, -(dmin[..., None] * mn.float())


def q4_k_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows ``raw`` ``[R, K / 256 * 144]`` uint8 -> (d ``[R, K / 32]`` float32, m ``[R, K /
    32]`` float32, q ``[R, K]`` uint8 in 0..15) with w = d q + m per block of 32 (m <= 0)."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, Q4_K_BYTES)
    nb = blocks.shape[1]
    dw, mw = _scales_mins(blocks)
    qs = blocks[..., 16:].view(r, nb, 4, 1, 32)  # 4 runs of 32 bytes: sub-blocks 2i (low), 2i+1
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(r, nb * QK_K)
    return dw.reshape(r, -1), mw.reshape(r, -1), q


def q5_k_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K rows ``raw`` ``[R, K / 256 * 176]`` uint8 -> as ``q4_k_codes``, q in 0..31 (the
    fifth bit of sub-block j's k t is bit j of byte t of the 32 ``qh`` bytes)."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, Q5_K_BYTES)
    nb = blocks.shape[1]
    dw, mw = _scales_mins(blocks)
    qh = blocks[..., 16:48].view(r, nb, 1, 32)
    qh = torch.cat([(qh >> j) & 1 for j in range(8)], dim=2)  # [R, nb, 8, 32]
    qs = blocks[..., 48:].view(r, nb, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=3).view(r, nb, 8, 32) | (qh << 4)
    return dw.reshape(r, -1), mw.reshape(r, -1), q.reshape(r, nb * QK_K)


def q6_k_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K rows ``raw`` ``[R, K / 256 * 210]`` uint8 -> (d ``[R, K / 16]`` float32, q ``[R,
    K]`` int8 in -32..31) with w = d q per sub-block of 16."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, Q6_K_BYTES)
    nb = blocks.shape[1]
    ql = blocks[..., :128].view(r, nb, 2, 1, 64)  # per half of 128 k: 64 bytes, two nibbles
    ql = torch.cat([ql & 15, ql >> 4], dim=3).reshape(r, nb, 2, 128)
    qh = blocks[..., 128:192].view(r, nb, 2, 1, 32)  # per half: 32 bytes, four 2-bit fields
    qh = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(r, nb, 2, 128)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).to(torch.int8).reshape(r, nb * QK_K)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [R, nb, 16]
    dw = _f16(blocks[..., 208:210])[..., None] * sc  # exact: 11 significant bits times 8
    return dw.reshape(r, -1), q


def dequantize(kind: str, form: tuple) -> torch.Tensor:
    """The float32 weights ``[R, K]`` of ``q4_k_codes`` / ``q6_k_codes``'s form, computed as
    the ``gguf`` package computes them (so equal bit for bit to what transformers loaded)."""
    if kind in ("Q4_K", "Q5_K"):
        d, m, q = form
        r = q.shape[0]
        return (d[..., None] * q.view(r, -1, 32).float() + m[..., None]).view(r, -1)
    d, q = form
    r = q.shape[0]
    return (d[..., None] * q.view(r, -1, 16).float()).view(r, -1)


_DECODE = {"Q4_K": (q4_k_codes, Q4_K_BYTES), "Q5_K": (q5_k_codes, Q5_K_BYTES),
           "Q6_K": (q6_k_codes, Q6_K_BYTES)}
_MULT = np.random.default_rng(35).integers(1, 1 << 62, _KEY_K + 1, dtype=np.uint64) | np.uint64(1)


def _keys(rows: torch.Tensor, k: int) -> list[int]:
    """float32 ``[R, >= 16]`` -> a 64-bit key per row of length k: a hash of k and its first 16
    values' bits (equal rows, equal keys; a collision only costs a failed check)."""
    bits = rows[:, :_KEY_K].contiguous().view(torch.int32).numpy().view(np.uint32)
    h = (bits.astype(np.uint64) * _MULT[:_KEY_K]).sum(1, dtype=np.uint64)  # wraps mod 2^64
    return (h ^ np.uint64(k * int(_MULT[_KEY_K]) % (1 << 64))).tolist()


def _first_values(kind: str, raw: np.ndarray) -> torch.Tensor:
    """The first 16 float32 values ``[R, 16]`` of each row of ``raw`` (its first super-block's
    first sub-block; the ``gguf`` package's arithmetic, as ``dequantize``): the index's keys
    without dequantising whole super-blocks."""
    b = torch.from_numpy(np.array(raw[:, :_DECODE[kind][1]]))
    if kind == "Q6_K":
        q = (b[:, :16] & 15) | ((b[:, 128:144] & 3) << 4)
        d = _f16(b[:, 208:210]) * b[:, 192:193].view(torch.int8)[:, 0].float()
        return d[:, None] * (q.to(torch.int16) - 32).float()
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = (b[:, 4] & 63).float(), (b[:, 8] & 63).float()
    q = b[:, 16:32] & 15 if kind == "Q4_K" else (b[:, 48:64] & 15) | ((b[:, 16:32] & 1) << 4)
    return (d * sc)[:, None] * q.float() - (dmin * mn)[:, None]


def _k_quant_tensors(path: str | Path) -> tuple[mmap.mmap, list[tuple[str, int, int, int]]]:
    """The file mapped, and its Q4_K / Q5_K / Q6_K tensors as (kind, byte offset, rows, bytes
    per row), from the GGUF header (``models.gguf_header.tensor_table``: v2 / v3, the
    metadata's values skipped; the ``gguf`` package's reader spends ~20 s on a 150k-token
    vocabulary)."""
    from specbatch.models.gguf_header import tensor_table

    table = tensor_table(path)
    with open(path, "rb") as handle:
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    tensors = []
    for _, kind, dims, offset in table:
        if kind in _DECODE:
            rows = int(np.prod(dims[1:], dtype=np.int64))
            tensors.append((kind, offset, rows, dims[0] // QK_K * _DECODE[kind][1]))
    return data, tensors


class GGUFCodes:
    """The Q4_K / Q5_K / Q6_K rows of a GGUF file, found by their float32 values.

    The first ``find`` indexes every such row by its first 16 values (the file memory-mapped;
    4 s for the 949k rows of Qwen2.5-Coder-1.5B Q4_K_M on 2 busy cores, 17 s at a load of 10). Raises ``ValueError`` for a file
    that is not GGUF v2 / v3. ``find`` then gives a float32 weight's codes where every row is
    some K-quant row of the file, checked bit for bit.
    """

    def __init__(self, path: str | Path) -> None:
        self._file, found = _k_quant_tensors(path)
        self._tensors: list[tuple[str, np.ndarray]] = []
        self._index: dict[int, list[tuple[int, int]]] | None = None  # built by the first find
        for kind, offset, rows, row_bytes in found:
            raw = np.frombuffer(self._file, np.uint8, rows * row_bytes, offset).reshape(rows, -1)
            self._tensors.append((kind, raw))

    def __len__(self) -> int:
        return sum(raw.shape[0] for _, raw in self._tensors)

    def _rows_index(self) -> dict[int, list[tuple[int, int]]]:
        """key -> the (tensor, row) pairs of that key; built once, at the first ``find`` (a
        forward whose weights are already packed never pays for it)."""
        if self._index is None:
            index: dict[int, list[tuple[int, int]]] = {}
            for i, (kind, raw) in enumerate(self._tensors):
                keys = _keys(_first_values(kind, raw), raw.shape[1] // _DECODE[kind][1] * QK_K)
                for row, key in enumerate(keys):
                    index.setdefault(key, []).append((i, row))
            self._index = index
        return self._index

    def find(self, weight: torch.Tensor) -> list[tuple[int, int, str, tuple]] | None:
        """``weight`` ``[N, K]`` float32 as runs ``(row0, row1, kind, form)`` in row order (kind
        ``"Q4_K"``, ``"Q5_K"`` or ``"Q6_K"``; form: ``q4_k_codes`` / ``q5_k_codes`` /
        ``q6_k_codes`` of rows row0..row1-1), or None unless every row is a K-quant row of the
        file whose codes give its bits exactly."""
        n, k = weight.shape
        if k % QK_K or n == 0 or weight.dtype != torch.float32:
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
        return [(r0, r1, kind, forms[0] if len(forms) == 1
                 else tuple(torch.cat(parts) for parts in zip(*forms)))
                for r0, r1, kind, forms in runs]

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
        return forms[0] if len(forms) == 1 else tuple(torch.cat(parts) for parts in zip(*forms))
