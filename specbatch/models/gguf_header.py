"""What a GGUF file's tensors are stored as, from its header alone: which dtype ``auto`` takes.

``--dtype auto`` runs a GGUF model in ``int8`` where the int8 kernels take its matmul weights'
4/8-bit codes (``config.auto_dtype``). ``int8_code_types`` answers that from the tensor table at
the head of the file (names, shapes, GGML types), without reading any weight: a few ms where
``gguf.GGUFReader`` parses every metadata array (the tokenizer's: ~2 s for SmolLM2 on a busy
machine). No torch, no numpy: the command line decides before anything heavy is imported.

Which weights the kernels take is decided by ``kernels/linear_cpu.py`` (``pack_q8``: a weight
whose float32 values are exactly Q4_1 or Q8_0 blocks, or rows of the GGUF's own Q4_K / Q5_K /
Q6_K / Q5_0 / Q5_1 tensors, ``kernels/kquant.py``). ``INT8_CODE_TYPES`` names the GGUF types that give such
weights; ``tests/unit/test_dtype_auto.py`` checks each against ``pack_q8`` (and that F32 / F16
/ Q4_0 weights are not taken).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from pathlib import Path

# GGUF types whose weights the int8 kernels take as codes (kernels/linear_cpu.pack_q8; the
# K-quants, Q5_0 and Q5_1 with the file's codes, kernels/kquant.GGUFCodes)
INT8_CODE_TYPES = ("Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")
# GGML type ids -> names (ggml.h; gguf.GGMLQuantizationType), those a model file may hold
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
              9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
              15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
              20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
              26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
              35: "TQ2_0", 39: "MXFP4"}
# GGML type names -> (elements per block, bytes per block), as gguf.GGML_QUANT_SIZES (ggml.c's
# type traits): what a tensor's data takes in the file
BLOCK_SIZES = {"F32": (1, 4), "F16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20),
               "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q8_1": (32, 40),
               "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
               "Q6_K": (256, 210), "Q8_K": (256, 292), "IQ2_XXS": (256, 66),
               "IQ2_XS": (256, 74), "IQ3_XXS": (256, 98), "IQ1_S": (256, 50),
               "IQ4_NL": (32, 18), "IQ3_S": (256, 110), "IQ2_S": (256, 82),
               "IQ4_XS": (256, 136), "I8": (1, 1), "I16": (1, 2), "I32": (1, 4), "I64": (1, 8),
               "F64": (1, 8), "IQ1_M": (256, 56), "BF16": (1, 2), "TQ1_0": (256, 54),
               "TQ2_0": (256, 66), "MXFP4": (32, 17)}
# GGUF metadata value types -> their size in bytes (8: string, 9: array, read apart)
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def tensor_types(path: str | Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, GGML type name, shape)`` of every tensor of the GGUF file at ``path``, in file
    order (an unknown type id reads as ``"type N"``; shape as GGUF writes it, the row length
    first). Reads the header only (memory-mapped). Raises ``ValueError`` for a file that is
    not GGUF version 2 or 3 or whose header is cut short, ``OSError`` where it cannot be
    read."""
    return [t[:3] for t in tensor_table(path)]


def tensor_table(path: str | Path) -> list[tuple[str, str, tuple[int, ...], int]]:
    """As ``tensor_types``, each tensor with the byte offset of its data in the file (the data
    section starts at the header's end rounded up to ``general.alignment``, 32 by default):
    ``(name, type, shape, offset)``. Raises as ``tensor_types``.

    A file's table is read once per process while its size and modification time stay the
    same (``_cached_table``): every engine an ``LLM`` builds reads it (the int8 weights' codes,
    ``kernels.kquant``), and skipping the tokenizer's ~49k metadata strings took ~25 ms a
    read, twice per ``generate`` call."""
    st = os.stat(path)
    return list(_cached_table(os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns,
                              str(path)))


@functools.lru_cache(maxsize=16)
def _cached_table(real: str, inode: int, size: int, mtime_ns: int, shown: str) -> tuple:
    """``tensor_table`` of the file at ``real`` (errors name it as ``shown``), remembered per
    (path, inode, size, modification time): a rewritten or replaced file is read again.
    Errors are not cached."""
    with open(real, "rb") as f:
        if f.read(8)[:4] != b"GGUF":
            raise ValueError(f"{shown}: not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return tuple(_parse(buf, shown))


def _parse(buf, where: str) -> list[tuple[str, str, tuple[int, ...], int]]:
    if len(buf) < 24:
        raise ValueError(f"{where}: GGUF header cut short")
    order = "<"
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:  # a big-endian file (the version reads byte-swapped)
        order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{where}: GGUF version {version} (2 or 3 expected)")
    u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
    try:
        n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
        pos, alignment = 24, 32

        def string(pos: int) -> tuple[str, int]:
            (n,) = u64.unpack_from(buf, pos)
            end = pos + 8 + n
            if end > len(buf):
                raise ValueError
            return bytes(buf[pos + 8:end]).decode("utf-8", "replace"), end

        def skip_value(kind: int, pos: int) -> int:
            if kind in _SCALAR_SIZE:
                return pos + _SCALAR_SIZE[kind]
            if kind == _STRING:
                (n,) = u64.unpack_from(buf, pos)
                return pos + 8 + n
            if kind == _ARRAY:
                item, count = u32.unpack_from(buf, pos)[0], u64.unpack_from(buf, pos + 4)[0]
                pos += 12
                if item in _SCALAR_SIZE:
                    return pos + count * _SCALAR_SIZE[item]
                for _ in range(count):  # strings (the tokenizer's) or nested arrays
                    pos = skip_value(item, pos)
                return pos
            raise ValueError(f"metadata value type {kind}")

        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = u32.unpack_from(buf, pos)
            if key == "general.alignment" and kind == 4:
                (alignment,) = u32.unpack_from(buf, pos + 4)
            pos = skip_value(kind, pos + 4)
        infos = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = u32.unpack_from(buf, pos)
            dims = struct.unpack_from(f"{order}{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            kind, offset = struct.unpack_from(order + "IQ", buf, pos)
            pos += 12
            infos.append((name, GGML_TYPES.get(kind, f"type {kind}"), tuple(dims), offset))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: GGUF header cut short or malformed"
                         + (f" ({e})" if str(e) else "")) from None
    start = -(-pos // max(alignment, 1)) * max(alignment, 1)
    return [(name, kind, dims, start + offset) for name, kind, dims, offset in infos]


def check_whole(path: str | Path) -> list[tuple[str, str, tuple[int, ...], int]]:
    """``tensor_table(path)``, after checking it. Raise ``ValueError`` unless the GGUF file at ``path`` holds all of its tensors' data:
    its header parses (``tensor_table``) and the file reaches the end of every tensor whose
    type's block size is known (``BLOCK_SIZES``). A download cut short otherwise failed deep
    in the conversion ("cannot reshape array of size 18214336 into shape (49152,612)", or a
    ``struct.error`` traceback for a cut header). ``OSError`` where it cannot be read."""
    size = os.path.getsize(path)
    table = tensor_table(path)
    for name, kind, shape, offset in table:
        if kind not in BLOCK_SIZES:
            continue
        per_block, block_bytes = BLOCK_SIZES[kind]
        end = offset + -(-math.prod(shape) // per_block) * block_bytes
        if end > size:
            raise ValueError(f"{path}: cut short: tensor {name} ({kind}) runs to byte {end} and "
                             f"the file ends at byte {size}; download it again")
    return table


def matmul_weights(tensors: list[tuple[str, str, tuple[int, ...]]]) -> list[tuple[str, str, int]]:
    """``(name, type, number of elements)`` of the tensors the engine multiplies with (the
    dense layers and the lm_head): every tensor of two or more dimensions except the token
    embedding where the file has its own ``output.weight`` (the embedding is then a lookup,
    not a matmul)."""
    names = {name for name, _, _ in tensors}
    out = []
    for name, kind, shape in tensors:
        if len(shape) >= 2 and not (name == "token_embd.weight" and "output.weight" in names):
            out.append((name, kind, math.prod(shape)))
    return out


def int8_code_types(path: str | Path) -> tuple[str, ...]:
    """The GGUF types, sorted, of the matmul weights (``matmul_weights``) of the GGUF file at
    ``path`` that the int8 kernels take as codes (``INT8_CODE_TYPES``), when those weights hold
    at least half of all matmul weight elements; else ``()`` (an F32 / F16 / BF16 file, a
    Q4_0 or K-quant one the kernels do not take, a file whose header cannot be read). The
    rest of a model that qualifies runs on float32 panels. Reads the header only."""
    try:
        weights = matmul_weights(tensor_types(path))
    except (OSError, ValueError):
        return ()
    taken = [t for t in weights if t[1] in INT8_CODE_TYPES]
    total = sum(n for _, _, n in weights)
    if not taken or 2 * sum(n for _, _, n in taken) < total:
        return ()
    return tuple(sorted({kind for _, kind, _ in taken}))


def weight_types(path: str | Path) -> tuple[str, ...]:
    """The GGUF types of the matmul weights of ``path``, most elements first (what the file
    is said to hold when ``auto`` keeps float32); ``()`` where the header cannot be read."""
    try:
        weights = matmul_weights(tensor_types(path))
    except (OSError, ValueError):
        return ()
    count: dict[str, int] = {}
    for _, kind, n in weights:
        count[kind] = count.get(kind, 0) + n
    return tuple(sorted(count, key=lambda k: -count[k]))
