"""KV and cache bookkeeping for the scheduler: who owns which page, charged in pages everywhere.

The unit is the page (`page_size` tokens; page size 1 is the common case). Room for a step is
`free pages + evictable pages` (the tree's unlocked pages can always be evicted); a request
holding `kv_len` tokens takes `pages_for(kv_len, n)` new pages to grow by n tokens, because its
last page's remaining room is used first. Token counts are converted to pages only here.

Ownership while a request holds a row (see `request.py`): `table[row, :prefix_len]` are the
tree's pages under the locked node `last_node`; `table[row, prefix_len:kv_len]` are the
request's own pages (`prefix_len` is page-aligned), which it must insert into the tree or free.
"""

from __future__ import annotations

import torch

from radixpool.worker.device_copy import to_device
from radixpool.worker.mem.kv_pool import KVPool, ReqToTokenPool, pages_for, tokens_within
from radixpool.worker.mem.radix_cache import MatchResult, RadixCache
from radixpool.worker.request import Req, Status


class KVManager:
    def __init__(self, pool: KVPool, rows: ReqToTokenPool, cache: RadixCache) -> None:
        self.pool = pool
        self.rows = rows
        self.cache = cache
        self.page_size = pool.page_size

    # ------------------------------------------------------------------ accounting (pages)
    def room(self) -> int:
        """Pages a step can take: free now, or freed by evicting unlocked tree pages."""
        return self.pool.free_pages + self.cache.evictable_size // self.page_size

    def pages_for(self, kv_len: int, extend: int) -> int:
        return pages_for(kv_len, extend, self.page_size)

    def tokens_within(self, kv_len: int, num_pages: int) -> int:
        return tokens_within(kv_len, num_pages, self.page_size)

    def decode_pages(self, reqs: list[Req]) -> int:
        """Pages one decode token each takes: one per request whose last page is full."""
        if self.page_size == 1:
            return len(reqs)
        return sum(1 for r in reqs if r.kv_len % self.page_size == 0)

    def fits_alone(self, num_tokens: int) -> bool:
        return num_tokens <= self.pool.capacity

    # ------------------------------------------------------------------ admission
    def match_and_lock(self, req: Req) -> tuple[MatchResult, int]:
        """Match the request's cached prefix and lock it; returns the match and the pages the
        lock took out of the evictable room."""
        match = self.cache.match_prefix(req.fill_ids[:req.seq_len - 1], req.namespace)
        evictable = self.cache.evictable_size
        self.cache.lock(match.node)
        return match, (evictable - self.cache.evictable_size) // self.page_size

    def unlock(self, match: MatchResult) -> None:
        self.cache.unlock(match.node)

    def attach(self, req: Req, match: MatchResult) -> bool:
        """Give the request a row pointing at its matched prefix (False: no row free)."""
        row = self.rows.alloc()
        if row is None:
            return False
        req.row, req.last_node = row, match.node
        req.prefix_len = req.kv_len = match.length
        if match.length:
            self.rows.table[row, :match.length] = match.slots
        return True

    # ------------------------------------------------------------------ allocation
    def allocate(self, prefill: list[Req], takes: list[int], decode: list[Req],
                 decode_pages: int) -> torch.Tensor:
        """Slots for one step (prefill requests first, then decode), written into their rows.

        Admission charged these pages against `room()`, so evicting makes them free.
        """
        need = decode_pages + sum(self.pages_for(r.kv_len, t) for r, t in zip(prefill, takes))
        if self.pool.free_pages < need:
            self.cache.evict((need - self.pool.free_pages) * self.page_size)
        if self.pool.free_pages < need:
            raise RuntimeError(f"KV accounting error: the step needs {need} pages, "
                               f"{self.pool.free_pages} free after eviction")
        table, parts = self.rows.table, []
        if prefill:
            last = [int(table[r.row, r.kv_len - 1]) if r.kv_len % self.page_size else 0
                    for r in prefill]
            slots = self.pool.alloc_extend([r.kv_len for r in prefill], takes, last)
            cursor = 0
            for req, take in zip(prefill, takes):
                table[req.row, req.kv_len:req.kv_len + take] = slots[cursor:cursor + take]
                cursor += take
            parts.append(slots)
        if decode:
            rows = to_device([r.row for r in decode], torch.int64, table.device)
            lens_host = [r.kv_len for r in decode]
            lens = to_device(lens_host, torch.int64, table.device)
            # the previous slot matters only with pages (the new token may share its page)
            last = table[rows, lens - 1] if self.page_size > 1 else lens
            slots = self.pool.alloc_decode(lens_host, last)
            table[rows, lens] = slots
            parts.append(slots)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    # ------------------------------------------------------------------ hand-over to the tree
    def cache_prefix(self, req: Req) -> None:
        """Insert the computed prefix into the tree and re-lock the deeper node.

        Slots the tree already had ([prefix_len, present)) are freed and the row re-pointed at
        the tree's copies; slots past the page-aligned end stay the request's.
        """
        slots = self.rows.table[req.row, :req.kv_len]
        present, node, tree_values = self.cache.insert_path(
            req.fill_ids[:req.kv_len], slots, req.namespace)
        if present > req.prefix_len:  # computed twice: free ours, point the row at the tree's
            self.pool.free(slots[req.prefix_len:present].clone())
            slots[req.prefix_len:present] = torch.cat(tree_values)[req.prefix_len:present]
        self.cache.lock(node)
        self.cache.unlock(req.last_node)
        req.last_node = node
        req.prefix_len = req.kv_len - req.kv_len % self.page_size

    def truncate(self, req: Req, kv_len: int) -> None:
        """Drop the request's KV past `kv_len` (a rejected draft's: never the tree's). Pages
        wholly past it are freed; the rest of its last page stays its own, to be overwritten."""
        assert req.prefix_len <= kv_len <= req.kv_len
        keep = -(-kv_len // self.page_size) * self.page_size
        if keep < req.kv_len:
            self.pool.free(self.rows.table[req.row, keep:req.kv_len].clone())
        req.kv_len = kv_len

    def release(self, req: Req) -> None:
        """Give back the row and the lock; the computed KV goes into the tree (so a retracted or
        finished request's prefix stays reusable), every other page it owns is freed. A draft
        still in flight (KV past the sequence) is dropped first: it was never verified.

        A request whose logits went non-finite (`kv_suspect`) gives the tree only its KV before
        the first token whose K or V is not finite, and the tree's own KV from that token on
        (chunks it cached earlier) is discarded where no other request holds it: attention
        spreads a NaN to every position whose softmax row sees it, even masked (0 x NaN), so a
        poisoned prompt would otherwise poison every later request sharing its prefix."""
        if req.kv_len > req.seq_len:
            self.truncate(req, req.seq_len)
        req.draft = []
        slots = self.rows.table[req.row, :req.kv_len].clone()
        clean = req.kv_len
        if req.kv_suspect:
            first_bad = self.pool.first_nonfinite(slots)
            clean = req.kv_len if first_bad is None else first_bad
        owned_from = req.prefix_len
        if clean > req.prefix_len:
            # The tree takes [present, aligned end); duplicates before it and the partial page
            # after it stay ours to free.
            present = self.cache.insert(req.fill_ids[:clean], slots[:clean], req.namespace)
            if present > req.prefix_len:
                self.pool.free(slots[req.prefix_len:present])
            owned_from = clean - clean % self.page_size
        self.pool.free(slots[owned_from:])
        self.cache.unlock(req.last_node)
        if clean < req.prefix_len:
            self.cache.discard(req.fill_ids[:req.prefix_len], clean, req.namespace)
        self.rows.free(req.row)
        req.row, req.last_node, req.kv_len, req.prefix_len = None, None, 0, 0
        req.pending = 0      # an in-flight token is dropped: a resumed request recomputes it
        req.decoding = False
        req.run_epoch += 1

    # ------------------------------------------------------------------ invariants
    def check(self, running: list[Req]) -> None:
        """Every page free, cached or owned by exactly one running request; locks balanced;
        evictable + protected + free + request-owned pages = capacity. O(capacity)."""
        self.cache.check()
        ps = self.page_size
        owned: list[int] = []
        for node in self.cache.nodes():
            owned.extend(node.value.tolist())
        expected_locks: dict[int, int] = {}
        request_pages = 0
        for req in running:
            assert req.status is Status.RUNNING and req.row is not None
            assert req.prefix_len % ps == 0 and req.prefix_len <= req.kv_len
            own = self.rows.table[req.row, req.prefix_len:req.kv_len].tolist()
            pages = {s // ps for s in own}
            request_pages += len(pages)
            owned.extend(p * ps + i for p in pages for i in range(ps))
            node = req.last_node
            while node.parent is not None:
                expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
                node = node.parent
        assert len(owned) == len(set(owned)), "a KV slot is owned twice"
        free = self.pool.free_slots_set()
        assert not free & set(owned), "a KV slot is both free and owned"
        assert len(free) + len(owned) == self.pool.capacity, \
            f"KV slots leaked: {self.pool.capacity - len(free) - len(owned)}"
        cached = self.cache.evictable_size + self.cache.protected_size
        assert cached % ps == 0, "the tree holds a partial page"
        assert cached // ps + self.pool.free_pages + request_pages == self.pool.num_pages, \
            "evictable + protected + free + owned pages != capacity"
        for node in self.cache.nodes():
            assert node.lock_ref == expected_locks.get(id(node), 0), "lock count unbalanced"
        assert self.rows.num_free() + len(running) == self.rows.table.shape[0], \
            "request rows leaked"
