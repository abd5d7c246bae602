"""The bytes of one packed row: the only module that writes or reads them.

A shard record (one ArrayRecord record) is one row of ``row_len`` tokens:

    offset  size            field
    0       4               magic  b"PPRW"
    4       2               format version (little-endian uint16) = ROW_FORMAT_VERSION
    6       2               row_len (uint16)
    8       2               number of segments in the row (uint16)
    10      6               reserved, zero
    16      2 * row_len     tokens, little-endian uint16, pad token 0
    16+2L   row_len         segment_ids, uint8: 1..n for the row's contexts, 0 = padding

Worked row (row_len 16, two contexts of 6 and 7 tokens, 3 tokens of padding):

    tokens      = [0 1 11 12 13 14 | 0 3 11 11 11 12 10 | 0 0 0]
    segment_ids = [1 1  1  1  1  1 | 2 2  2  2  2  2  2 | 0 0 0]
    positions   = [0 1  2  3  4  5 | 0 1  2  3  4  5  6 | 0 0 0]   (derived, not stored)

Loss at position t exists only where segment_ids[t] == segment_ids[t+1] != 0.

Reading a row is three ``np.frombuffer`` calls (see ``decode_row``); the trainer
derives positions and targets on the device. No pickle anywhere.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"PPRW"
ROW_FORMAT_VERSION = 1
HEADER_SIZE = 16
MAX_SEGMENTS = 255  # segment ids are uint8
_HEADER = struct.Struct("<4sHHH6x")


class RowFormatError(ValueError):
    """A record whose bytes are not a row of this format."""


def record_size(row_len: int) -> int:
    return HEADER_SIZE + 3 * row_len


def encode_row(tokens: np.ndarray, segment_ids: np.ndarray) -> bytes:
    """One row's record bytes. ``tokens`` and ``segment_ids`` have the same length."""
    row_len = len(tokens)
    if len(segment_ids) != row_len:
        raise ValueError("tokens and segment_ids differ in length")
    n_segments = int(segment_ids.max()) if row_len else 0
    if n_segments > MAX_SEGMENTS:
        raise ValueError(f"{n_segments} segments in a row; at most {MAX_SEGMENTS}")
    header = _HEADER.pack(MAGIC, ROW_FORMAT_VERSION, row_len, n_segments)
    return (
        header
        + np.asarray(tokens, dtype="<u2").tobytes()
        + np.asarray(segment_ids, dtype=np.uint8).tobytes()
    )


def new_block(n_segments: np.ndarray, row_len: int, *, zeroed: bool = True,
              buffer: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block, tokens, segment_ids): a uint8[n_rows, record_size] block of records with
    headers filled in, and writable [n_rows, row_len] views of its token and segment-id
    fields, zero (padding) until the caller fills them; with ``zeroed`` False, whatever the
    memory held (a caller that writes every cell). ``buffer``: uint8 memory to build it in,
    at its start (``zeroed`` then says nothing). Row r's record is ``block[r].tobytes()``.
    """
    n_segments = np.asarray(n_segments)
    if len(n_segments) and int(n_segments.max()) > MAX_SEGMENTS:
        raise ValueError(f"more than {MAX_SEGMENTS} segments in a row")
    n_rows, size = len(n_segments), record_size(row_len)
    if buffer is not None:
        block = buffer[:n_rows * size].reshape(n_rows, size)
    else:
        block = (np.zeros if zeroed else np.empty)((n_rows, size), np.uint8)
    block[:, :HEADER_SIZE] = np.frombuffer(_HEADER.pack(MAGIC, ROW_FORMAT_VERSION, row_len, 0),
                                           np.uint8)
    block[:, 8:10] = n_segments.astype("<u2").reshape(n_rows, 1).view(np.uint8)
    tokens = block[:, HEADER_SIZE:HEADER_SIZE + 2 * row_len].view("<u2")
    return block, tokens, block[:, HEADER_SIZE + 2 * row_len:]


def encode_block(tokens: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """uint8[n_rows, record_size(row_len)] records of a [n_rows, row_len] block of rows."""
    n_rows, row_len = tokens.shape
    n_segments = segment_ids.max(axis=1) if n_rows and row_len else np.zeros(n_rows, np.int64)
    block, tok, seg = new_block(n_segments, row_len)
    tok[:] = tokens
    seg[:] = segment_ids
    return block


def encode_rows(tokens: np.ndarray, segment_ids: np.ndarray) -> list[bytes]:
    """Record bytes for a [n_rows, row_len] block of rows."""
    block = encode_block(tokens, segment_ids)
    return [block[r].tobytes() for r in range(len(block))]


def decode_row(record: bytes, *, where: str = "record") -> tuple[np.ndarray, np.ndarray]:
    """(tokens uint16[row_len], segment_ids uint8[row_len]) of one record, validated.

    ``where`` names the shard and record in the error, e.g. ``"shards/train/x.array_record#12"``.
    """
    if len(record) < HEADER_SIZE:
        raise RowFormatError(f"{where}: {len(record)} bytes is shorter than a row header; "
                             "re-run `prep shards` to rebuild the dataset")
    magic, version, row_len, n_segments = _HEADER.unpack_from(record)
    if magic != MAGIC:
        raise RowFormatError(f"{where}: not a ping-pack row (magic {magic!r}); "
                             "re-run `prep shards` to rebuild the dataset")
    if version != ROW_FORMAT_VERSION:
        raise RowFormatError(f"{where}: row format version {version}, this code reads "
                             f"{ROW_FORMAT_VERSION}; re-run `prep shards` with this version")
    if len(record) != record_size(row_len):
        raise RowFormatError(f"{where}: {len(record)} bytes, expected {record_size(row_len)} "
                             f"for row_len {row_len}; the shard is damaged, re-run `prep shards`")
    tokens = np.frombuffer(record, dtype="<u2", count=row_len, offset=HEADER_SIZE)
    segment_ids = np.frombuffer(record, dtype=np.uint8, count=row_len,
                                offset=HEADER_SIZE + 2 * row_len)
    return tokens, segment_ids


def check_record(record: bytes, row_len: int, *, where: str = "record") -> None:
    """RowFormatError, worded by ``decode_row``, unless ``record`` is a row of ``row_len``."""
    tokens, _ = decode_row(record, where=where)
    if len(tokens) != row_len:
        raise RowFormatError(f"{where}: row_len {len(tokens)}, the manifest says {row_len}; "
                             "re-run `prep shards` to rebuild the dataset")


@dataclass(frozen=True)
class Block:
    """Records decoded side by side (``decode_block``): the rows are the records of the
    expected size, in record order; nothing is validated beyond the header's columns."""
    fits: np.ndarray  # bool[n_records]: the record has record_size(row_len) bytes
    index: np.ndarray  # int64[n_rows]: the record each row came from
    header_ok: np.ndarray  # bool[n_rows]: magic, format version and row_len as expected
    tokens: np.ndarray  # uint16[n_rows, row_len] (a view of the joined records)
    segment_ids: np.ndarray  # uint8[n_rows, row_len]
    headers: np.ndarray  # uint8[n_rows, HEADER_SIZE] (a view)

    @property
    def n_segments(self) -> np.ndarray:
        """int64[n_rows]: the header's segment count (verify's; the reader needs none)."""
        return self.headers[:, 8:10].view("<u2")[:, 0].astype(np.int64)

    @property
    def sound(self) -> bool:
        """Every record fits and every header is as expected."""
        return bool(self.fits.all() and self.header_ok.all())

    def first_bad(self) -> int | None:
        """The first record (index) that does not fit or whose header is not as expected."""
        bad = np.union1d(np.flatnonzero(~self.fits), self.index[~self.header_ok])
        return int(bad[0]) if len(bad) else None


def decode_block(records: list[bytes], row_len: int) -> Block:
    """Many records of ``row_len`` at once: one join, headers checked as columns. A record
    of another size is left out of the rows (``fits``); ``decode_row`` words what is wrong."""
    size = record_size(row_len)
    fits = np.fromiter(map(len, records), np.int64, len(records)) == size
    index = np.arange(len(records)) if fits.all() else np.flatnonzero(fits)
    joined = b"".join(records) if len(index) == len(records) else b"".join(
        [records[i] for i in index.tolist()])
    block = np.frombuffer(joined, np.uint8).reshape(len(index), size)
    prefix = np.frombuffer(_HEADER.pack(MAGIC, ROW_FORMAT_VERSION, row_len, 0)[:8], np.uint8)
    return Block(fits, index, header_ok=(block[:, :8] == prefix).all(axis=1),
                 tokens=block[:, HEADER_SIZE:HEADER_SIZE + 2 * row_len].view("<u2"),
                 segment_ids=block[:, HEADER_SIZE + 2 * row_len:], headers=block[:, :HEADER_SIZE])


def positions(segment_ids: np.ndarray) -> np.ndarray:
    """Position of each token within its segment (0 at each segment start and on padding)."""
    seg = np.asarray(segment_ids)
    idx = np.arange(seg.shape[-1])
    starts = np.concatenate([np.ones(seg.shape[:-1] + (1,), bool),
                             seg[..., 1:] != seg[..., :-1]], axis=-1)
    start_idx = np.maximum.accumulate(np.where(starts, idx, 0), axis=-1)
    return np.where(seg > 0, idx - start_idx, 0)


def loss_mask(segment_ids: np.ndarray) -> np.ndarray:
    """True at t where the token at t+1 is a target: same segment, not padding."""
    seg = np.asarray(segment_ids)
    nxt = np.concatenate([seg[..., 1:], np.zeros(seg.shape[:-1] + (1,), seg.dtype)], axis=-1)
    return (seg == nxt) & (seg != 0)
