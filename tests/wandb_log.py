"""Reading a W&B offline run's transaction log (``run-<id>.wandb``) in tests.

The file is LevelDB's log format (a 7-byte header ``:W&B`` + magic + version,
then 32 KiB blocks of records, each with a 7-byte header: CRC-32, length, type
full/first/middle/last), each record a serialised ``wandb.proto`` ``Record``.
"""

import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path):
    """Every ``Record`` in the file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        block_left = BLOCK - pos % BLOCK
        if block_left < HEADER:  # too little room for a header: padding
            pos += block_left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:
            pos += block_left
            continue
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        pending += payload
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record
