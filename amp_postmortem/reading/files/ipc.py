"""Reading an Arrow IPC stream (a journal) without trusting it: each record
batch's decoded size is read from its message's metadata and checked
before the batch is decoded, so a small lz4-compressed file cannot inflate
into gigabytes first (pyarrow offers no such bound itself).

The metadata of an IPC message is a flatbuffer (Arrow's Message.fbs):
`Message{version, header_type, header, bodyLength, ...}` whose header, for
a record batch, is `RecordBatch{length, nodes, buffers, compression, ...}`;
`buffers` are (offset, length) pairs into the message body. Uncompressed,
a buffer decodes to its own length; compressed, each buffer starts with
its decoded length as an int64 (-1: stored as is). Only these few fields
are read, by hand: the format is fixed by Arrow's columnar specification.
"""
from __future__ import annotations

import struct

import pyarrow as pa

_RECORD_BATCH = 3   # MessageHeader union: Schema 1, DictionaryBatch 2, RecordBatch 3


class Unbounded(Exception):
    """A message whose decoded size is past the caller's limit, or whose
    metadata does not say it (the reader refuses it rather than decoding)."""


def _table(buf: bytes, pos: int) -> tuple[int, int, int]:
    """(table position, its vtable position, the vtable's size) of the
    flatbuffer table at `pos`."""
    vtable = pos - struct.unpack_from("<i", buf, pos)[0]
    return pos, vtable, struct.unpack_from("<H", buf, vtable)[0]


def _field(buf: bytes, table: tuple[int, int, int], index: int) -> int | None:
    """The position of field `index` of `table`, None when absent."""
    pos, vtable, vsize = table
    slot = 4 + 2 * index
    if slot + 2 > vsize:
        return None
    off = struct.unpack_from("<H", buf, vtable + slot)[0]
    return pos + off if off else None


def _deref(buf: bytes, at: int) -> int:
    return at + struct.unpack_from("<I", buf, at)[0]


def decoded_size(message: pa.ipc.Message) -> int:
    """Bytes the record batch in `message` decodes to, from its metadata
    (and, compressed, the length prefixes of its body's buffers)."""
    buf = message.metadata.to_pybytes()
    body = message.body
    try:
        msg = _table(buf, struct.unpack_from("<I", buf, 0)[0])
        kind_at, header_at = _field(buf, msg, 1), _field(buf, msg, 2)
        kind = buf[kind_at] if kind_at is not None else 0
        if kind != _RECORD_BATCH or header_at is None:
            # Dictionaries included: the format's journals hold none.
            raise Unbounded(f"a message of kind {kind} where record batches were expected")
        batch = _table(buf, _deref(buf, header_at))
        buffers_at = _field(buf, batch, 2)
        compressed = _field(buf, batch, 3) is not None
        if buffers_at is None:
            return 0
        vec = _deref(buf, buffers_at)
        count = struct.unpack_from("<I", buf, vec)[0]
        total = 0
        for i in range(count):
            offset, length = struct.unpack_from("<qq", buf, vec + 4 + 16 * i)
            if offset < 0 or length < 0 or offset + length > body.size:
                raise Unbounded("a buffer outside the message body")
            if compressed and length >= 8:
                (size,) = struct.unpack_from("<q", body, offset)
                total += length - 8 if size == -1 else size
            else:
                total += length
        return total
    except (struct.error, IndexError, ValueError) as exc:
        raise Unbounded(f"unreadable message metadata ({exc})") from None


def read_stream_prefix(source, limit: int) -> tuple[pa.Schema | None, list[pa.RecordBatch]]:
    """The schema and the complete record batches of an IPC stream, as
    `recorders.journal.read_prefix` reads them (a torn message ends the
    prefix), each batch's decoded size checked against what is left of
    `limit` before it is decoded: `Unbounded` past it."""
    try:
        reader = pa.ipc.MessageReader.open_stream(source)
        first = reader.read_next_message()
        stream_schema = pa.ipc.read_schema(first)
    except (OSError, pa.ArrowInvalid, StopIteration):
        return None, []
    batches, left = [], limit
    while True:
        try:
            message = reader.read_next_message()
        except StopIteration:
            break
        except (OSError, pa.ArrowInvalid):
            break  # a torn last message: what came before stands
        size = decoded_size(message)
        if size > left:
            raise Unbounded(f"its record batches decode to more than {limit} bytes")
        left -= size
        try:
            batches.append(pa.ipc.read_record_batch(message, stream_schema))
        except (OSError, pa.ArrowInvalid):
            break
    return stream_schema, batches
