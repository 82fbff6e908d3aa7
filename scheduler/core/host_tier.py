"""The host-memory tier of one executor's KV cache (`--kv-host-memory`): which prefix-cache
blocks its host blocks hold, least recently used first.

The tier holds only full, cached blocks: a device block whose hash the pool evicts to hand the
block out again is copied here first (a spill), and a prefix hit here is copied back into a
fresh device block (a load) instead of being computed again. The scheduler decides every copy;
the executor runs a step's copies, in order, before the step's forward pass
(`StepPlan.block_copies`). A host block named by a copy of the plan being built is pinned until
that plan is sent, so no later copy of the same plan overwrites it.
"""

from __future__ import annotations

from collections import OrderedDict

from npuserve.scheduler.core.block_hash import BlockHash


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0 first
        self._blocks: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._hash_of: dict[int, BlockHash] = {}
        self._pinned: set[int] = set()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The host block holding ``block_hash``, now the most recently used; None: not here."""
        block_id = self._blocks.get(block_hash)
        if block_id is not None:
            self._blocks.move_to_end(block_hash)
            self._pinned.add(block_id)
        return block_id

    def store(self, block_hash: BlockHash) -> tuple[int | None, BlockHash | None]:
        """A host block to copy ``block_hash``'s device block into, and the hash it held before
        (dropped from the tier), or (None, None) when every block is pinned. A hash already
        here needs no copy: (None, None) too, and `__contains__` says so."""
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return None, None
        dropped: BlockHash | None = None
        if self._free:
            block_id = self._free.pop()
        else:
            victim = next((h for h, b in self._blocks.items() if b not in self._pinned), None)
            if victim is None:
                return None, None
            block_id = self._blocks.pop(victim)
            del self._hash_of[block_id]
            dropped = victim
        self._blocks[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        self._pinned.add(block_id)
        return block_id, dropped

    def drop(self, block_id: int) -> BlockHash | None:
        """Forgets what host block ``block_id`` holds (a copy into it never ran); its hash."""
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._blocks[block_hash]
            self._free.append(block_id)
        self._pinned.discard(block_id)
        return block_hash

    def unpin(self) -> None:
        """The plan whose copies pinned blocks is built: later plans' copies run after its own."""
        self._pinned.clear()

    def check_integrity(self) -> None:
        held = set(self._blocks.values())
        assert len(held) == len(self._blocks), "two hashes share a host block"
        assert held.isdisjoint(self._free), "a host block is both free and held"
        assert len(held) + len(self._free) == self.num_blocks, (
            f"{len(held)} held + {len(self._free)} free != {self.num_blocks} host blocks"
        )
        assert all(self._hash_of[b] == h for h, b in self._blocks.items()), "host block map corrupt"
