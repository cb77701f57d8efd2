"""Writes kv-events.json: KV event batches encoded by vLLM's own classes.

Run with the Python of a vLLM install (it imports vllm and msgspec):

    .hearth/vllm/venv/bin/python wire/golden/kv-events.py wire/golden/kv-events.json
"""

import json
import sys

import msgspec

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldCleared]
    data_parallel_rank: int | None = None


def stored(hashes, parent, tokens, medium="GPU", **extra):
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(tokens)),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        **extra,
    )


# What each case should decode to: hashes as the reader names them
# (integers as their 64 bits, bytes folded), in decimal strings.
def u64(h):
    if isinstance(h, bytes):
        v = 0xCBF29CE484222325
        for b in h:
            v = ((v ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        return str(v)
    return str(h & 0xFFFFFFFFFFFFFFFF)


def expect(batch):
    out = []
    for e in batch.events:
        kind = type(e).__name__.replace("Old", "")
        kind = {"Cleared": "AllBlocksCleared"}.get(kind, kind)
        item = {"type": kind}
        if hasattr(e, "block_hashes"):
            item["hashes"] = [u64(h) for h in e.block_hashes]
        if hasattr(e, "parent_block_hash"):
            p = e.parent_block_hash
            item["parent"] = None if p is None else u64(p)
            item["tokens"] = len(e.token_ids)
            item["block_size"] = e.block_size
        medium = getattr(e, "medium", None)
        item["offloaded"] = medium not in (None, "GPU")
        out.append(item)
    return {"ts": batch.ts, "rank": batch.data_parallel_rank, "events": out}


sha = [bytes([i]) * 32 for i in range(1, 5)]
cases = {
    "map_int_hashes": KVEventBatch(
        ts=1764790000.25,
        events=[
            stored([11, 12, 2**63 + 5], None, 48),
            stored([13], 2**63 + 5, 16, group_idx=0, session_id="s"),
            BlockRemoved(block_hashes=[11], medium="GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    ),
    "map_signed_hashes": KVEventBatch(
        ts=2.0,
        events=[
            stored([-1, -(2**63), 5], -1, 48),
            BlockRemoved(block_hashes=[-1, 2**64 - 1], medium=None, group_idx=1),
        ],
        data_parallel_rank=3,
    ),
    "map_byte_hashes": KVEventBatch(
        ts=3.5,
        events=[
            stored(sha[:2], None, 32, extra_keys=[None, ("lora-a",)]),
            stored(sha[2:3], sha[1], 16, medium="CPU"),
            BlockRemoved(block_hashes=sha[:1], medium="GPU"),
        ],
        data_parallel_rank=0,
    ),
    "map_no_rank": KVEventBatch(ts=4.0, events=[AllBlocksCleared()]),
    "array_old_form": OldBatch(
        ts=5.0,
        events=[
            OldBlockStored([7, 8], None, list(range(32)), 16, None),
            OldBlockRemoved([7]),
            OldCleared(),
        ],
    ),
}

enc = msgspec.msgpack.Encoder()
with open(sys.argv[1], "w") as out:
    out.write(
        json.dumps(
            [
                {"name": name, "msgpack": enc.encode(batch).hex(), **expect(batch)}
                for name, batch in cases.items()
            ],
            indent=1,
        )
        + "\n"
    )
