"""The quantized formats jinfer multiplies: their blocks, the records a loader makes of ggml's, and
the fields the kernel's layout takes for each arithmetic (`jinfer.models.quantized` holds the
weights and their products).

    format   one block of one row                                    bytes per weight
    q8_0     32 inputs: float16 d, int8 q:  w = d q                   34 / 32   (file: same)
    q4_0     32 inputs: float16 d, 4-bit q:  w = d (q - 8)            18 / 32   (same)
    q4_1     32 inputs: float16 d, m, 4-bit q:  w = d q + m           20 / 32   (same)
    q4_k     256 inputs: float16 d, dmin; per 32: sc, m (6 bits,
             held as bytes), 4-bit q:  w = d sc q - dmin m            148 / 256 (file: 144)
    q6_k     256 inputs: float16 d; per 16: int8 sc; 6-bit q - 32
             (held as int8):  w = d sc q                              274 / 256 (file: 210)
    q5_0, q5_1, q5_k   as q8_0 (q - 16), q4_1 and q4_k with 5-bit q
             held as bytes                                  34 / 32, 36 / 32, 276 / 256
                                                            (file: 22, 24, 176)

These are ggml's blocks (GGUF's tensors of those types). A record holds one block of one row,
field by field (`QuantFormat.fields`); `records_from_ggml` makes them from ggml's bytes (for the
32-input types ggml's bytes as they are). The kernel's layout puts R rows side by side per field;
for integer products (`INTEGER_FORMATS`, int8 activations) it holds 4 inputs of a row together,
the signed types' int8 as q + 128 (`layout_fields`, `flip_signs`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

# The formats with integer products (`QuantizedWeight.activations` "int8").
INTEGER_FORMATS = frozenset({"q8_0", "q5_0", "q4_0", "q4_1", "q5_1"})


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A block format: `group` inputs of one row per block, held as a record of `fields` (name,
    count, bytes each), in order. Records of Q8_0 / Q4_0 / Q4_1 are ggml's blocks byte for byte;
    those of the K-quants unpack ggml's (6-bit scales to bytes, Q6_K's 6-bit integers to int8) so
    the kernel reads whole bytes."""

    name: str
    group: int
    fields: tuple[tuple[str, int, int], ...]
    ggml_block_bytes: int
    signed: bool = False  # int8 integers, which integer products hold as unsigned bytes q + 128

    @property
    def record_bytes(self) -> int:
        return sum(count * size for _, count, size in self.fields)


_NIBBLES = ("q", 16, 1)  # 32 4-bit integers: byte j holds input j (low nibble) and j + 16 (high)
_BYTES = ("q", 32, 1)  # 32 integers, a byte each
FORMATS = {
    "q8_0": QuantFormat("q8_0", 32, (("d", 1, 2), _BYTES), 34, signed=True),  # w = d q
    "q4_0": QuantFormat("q4_0", 32, (("d", 1, 2), _NIBBLES), 18),  # w = d (q - 8)
    "q4_1": QuantFormat("q4_1", 32, (("d", 1, 2), ("m", 1, 2), _NIBBLES), 20),  # w = d q + m
    # 8 x 32 inputs: w = d sc[s] q - dmin m[s] (sc, m: 6 bits), q as in q4 per sub-block s
    "q4_k": QuantFormat(
        "q4_k", 256, (("d", 1, 2), ("dmin", 1, 2), ("sc", 8, 1), ("m", 8, 1), ("q", 128, 1)), 144
    ),
    # 16 x 16 inputs: w = d sc[s] q (sc int8, q the 6-bit integer - 32 as int8)
    "q6_k": QuantFormat("q6_k", 256, (("d", 1, 2), ("sc", 16, 1), ("q", 256, 1)), 210),
    # 5-bit integers held as bytes: q5_0 w = d q (q - 16 as int8: q8_0's record), q5_1 w = d q + m,
    # q5_k as q4_k
    "q5_0": QuantFormat("q5_0", 32, (("d", 1, 2), _BYTES), 22, signed=True),
    "q5_1": QuantFormat("q5_1", 32, (("d", 1, 2), ("m", 1, 2), _BYTES), 24),
    "q5_k": QuantFormat(
        "q5_k", 256, (("d", 1, 2), ("dmin", 1, 2), ("sc", 8, 1), ("m", 8, 1), ("q", 256, 1)), 176
    ),
}


def _five_bits(low: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """4-bit integers and their fifth bits (0/1), both in input order -> the 5-bit integers."""
    return low | (bits << 4)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's 12 bytes of 6-bit sub-block scales and offsets per K-quant block -> [blocks, 8] each."""
    low, high, both = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([low & 63, (both & 15) | ((low >> 2) & 48)], axis=1)
    m = np.concatenate([high & 63, (both >> 4) | ((high >> 2) & 48)], axis=1)
    return sc, m


def records_from_ggml(format: QuantFormat, raw: np.ndarray) -> np.ndarray:
    """Rows of ggml blocks [rows, blocks x ggml bytes] -> rows of records [rows, blocks x record
    bytes] (the same values; for Q8_0 / Q4_0 / Q4_1 the same bytes)."""
    if format.ggml_block_bytes == format.record_bytes:
        return raw
    rows = raw.shape[0]
    blocks = raw.reshape(-1, format.ggml_block_bytes)
    if format.name in ("q4_k", "q5_k"):
        d, (sc, m) = blocks[:, :4], _k_scales(blocks[:, 4:16])
        qs = blocks[:, -128:].reshape(-1, 4, 32)  # per 64 inputs: low nibbles, then high ones
        values = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
        if format.name == "q4_k":
            q = (values[:, :, :16] | (values[:, :, 16:] << 4)).reshape(-1, 128)
        else:  # qh: bit s of byte l is input 32 s + l's fifth bit
            qh = blocks[:, 16:48]
            bits = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            q = _five_bits(values, bits).reshape(-1, 256)
        records = np.concatenate([d, sc, m, q], axis=1)
    elif format.name in ("q5_0", "q5_1"):
        header = 2 if format.name == "q5_0" else 4
        d, qh, qs = blocks[:, :header], blocks[:, header : header + 4], blocks[:, header + 4 :]
        bits = (qh.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1  # input i: bit i
        q = _five_bits(np.concatenate([qs & 15, qs >> 4], axis=1), bits.astype(np.uint8))
        if format.name == "q5_0":
            q = (q.astype(np.int16) - 16).astype(np.int8).view(np.uint8)
        records = np.concatenate([d, q], axis=1)
    else:  # q6_k
        ql, qh, sc, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], blocks[:, 208:]
        low = np.stack([ql.reshape(-1, 2, 64) & 15, ql.reshape(-1, 2, 64) >> 4], axis=2).reshape(-1, 8, 32)
        shifts = np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
        high = ((qh.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
        q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).view(np.uint8).reshape(-1, 256)
        records = np.concatenate([d, sc, q], axis=1)
    return records.reshape(rows, -1)


def layout_fields(fmt: QuantFormat, activations: str) -> tuple[tuple[str, int, int], ...]:
    """The record's fields as the kernel's layout for `activations` takes them, items of `size`
    bytes with R rows side by side: integer products (int8) hold 4 inputs of a row together, so
    their integers are items of 4 bytes; float products read a byte of R rows per load."""
    if activations != "int8":
        return fmt.fields
    return tuple(
        (name, count // 4, 4) if name == "q" else (name, count, size) for name, count, size in fmt.fields
    )


def flip_signs(fmt: QuantFormat, records: np.ndarray) -> np.ndarray:
    """Records [..., record bytes] with a signed format's int8 integers as integer products hold
    them, q + 128 as unsigned bytes (their sign bit flipped; flipped again, they are the file's)."""
    if not fmt.signed:
        return records
    at = sum(count * size for _, count, size in fmt.fields[:-1])  # the integers come last
    flipped = records.copy()
    flipped[..., at:] ^= 0x80
    return flipped
