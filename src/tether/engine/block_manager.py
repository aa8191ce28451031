"""``BlockManager``: the paged KV pool's bookkeeping -- block tables, reference counts, prefix cache.

The pool is ``num_blocks`` blocks of ``block_size`` token slots (the tensors live in the runner;
slot ``block_id * block_size + offset``). A sequence owns a block table; blocks are shared by
reference count:

* Prefix caching: a block that is full *and computed* is registered under a chain hash of
  (parent block's hash, its tokens). A new sequence whose leading blocks hash the same reuses them.
  Registering only computed blocks means a hit never points at KV that is still to be written.
* Forking: the followers of a group take the leader's whole table once the prompt is computed.
  The last, partial block is then shared, so the first write into it copies it (copy-on-write);
  copies are queued as (src, dst) pairs that the runner applies before the next forward.

Freed blocks keep their hash until reused, so a finished prompt stays cached until evicted
(least recently freed first; uncached blocks are reused before cached ones).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tether.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # chain hash, set once the block is full and computed
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # the tokens behind ``hash``; checked on a hit


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, next to reuse first. Ordered dict: O(1) pop-front and removal.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def num_blocks_to_allocate(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks that ``allocate(seq, num_new_tokens)`` would take (new ones plus a copy)."""
        num_needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        num_missing = max(0, num_needed - len(seq.block_table))
        return num_missing + int(self._is_copy_on_write(seq))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_to_allocate(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` writable slots for its next ``num_new_tokens`` tokens. Check ``can_allocate``."""
        if self._is_copy_on_write(seq):
            index = seq.num_computed_tokens // self.block_size
            shared = self.blocks[seq.block_table[index]]
            copy = self._take_free_block()
            shared.ref_count -= 1  # stays >= 1: another sequence still holds it
            seq.block_table[index] = copy.block_id
            self._pending_copies.append((shared.block_id, copy.block_id))
        num_needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        while len(seq.block_table) < num_needed:
            seq.block_table.append(self._take_free_block().block_id)

    def match_prefix(self, seq: Sequence) -> int:
        """Reuse cached blocks for ``seq``'s leading full blocks; returns the number of tokens hit.

        Only blocks strictly before the last token are matched: the last token must be computed
        to get the logits of the next one. ``seq`` must hold no blocks.
        """
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"match_prefix on sequence {seq.seq_id} that already holds blocks")
        if not self.enable_prefix_caching:
            return 0
        parent_hash = None
        for index in range((seq.num_tokens - 1) // self.block_size):
            start = index * self.block_size
            token_ids = tuple(seq.token_ids[start : start + self.block_size])
            block_hash = chain_hash(parent_hash, token_ids)
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != token_ids or block.parent_hash != parent_hash:
                break  # a hash collision: never trust the hash alone
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            parent_hash = block_hash
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def commit(self, seq: Sequence, num_computed_before: int) -> None:
        """Register the blocks that became full and computed since ``num_computed_before``."""
        if not self.enable_prefix_caching or seq.is_kv_stale:
            return
        bs = self.block_size
        for index in range(num_computed_before // bs, seq.num_computed_tokens // bs):
            block = self.blocks[seq.block_table[index]]
            if block.hash is not None:
                continue  # shared from the cache, already registered
            parent_hash = self.blocks[seq.block_table[index - 1]].hash if index > 0 else None
            if index > 0 and parent_hash is None:
                return  # the chain was cut by a cache flush; later blocks cannot be keyed
            block.parent_hash = parent_hash
            block.token_ids = tuple(seq.token_ids[index * bs : (index + 1) * bs])
            block.hash = chain_hash(parent_hash, block.token_ids)
            # A twin computed in the same step keeps the first registration; both keep the hash
            # so that their children can still chain.
            self._hash_to_block.setdefault(block.hash, block.block_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks and computed tokens."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.is_kv_stale = parent.is_kv_stale

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; its tokens count as uncomputed again."""
        # Tail first: with least-recently-freed reuse, a prompt's head outlives its tail in the cache.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if self._hash_to_block.get(block.hash) != block_id:  # not in the cache (a twin's
                    self._free.move_to_end(block_id, last=False)  # hash is the other's): reuse first
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.is_kv_stale = False  # whatever it recomputes uses the current weights

    def flush_prefix_cache(self) -> None:
        """Forget every cached block (after a weight update the cached KV is stale)."""
        self._hash_to_block.clear()
        for block in self.blocks:
            block.hash = None
            block.parent_hash = None
            block.token_ids = ()

    def forget(self, block_ids: list[int]) -> None:
        """Take ``block_ids`` out of the prefix cache (their KV must not be reused)."""
        for block_id in block_ids:
            self._unregister(self.blocks[block_id])

    def _unregister(self, block: Block) -> None:
        if block.hash is not None and self._hash_to_block.get(block.hash) == block.block_id:
            del self._hash_to_block[block.hash]
        block.hash, block.parent_hash, block.token_ids = None, None, ()

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued by copy-on-write since the last call."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def _is_copy_on_write(self, seq: Sequence) -> bool:
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self.blocks[seq.block_table[index]].ref_count > 1

    def _take_free_block(self) -> Block:
        if not self._free:
            raise RuntimeError("KV block pool exhausted; the scheduler must check can_allocate first")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        self._unregister(block)
        block.ref_count = 1
        return block
