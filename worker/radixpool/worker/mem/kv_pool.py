"""Paged KV memory: the K/V tensors of every layer, and who may write which slot.

A *slot* holds the K and V of one token in every layer (`k_buffers[layer][slot]`). Slots are
grouped into pages of `page_size` consecutive slots; the page is the unit of allocation, so with
`page_size > 1` a request's tokens fill its last page before a new one is taken, and the radix
cache only ever shares whole pages. Page 0 is never handed out: padded lanes (fixed-shape decode
batches) write their garbage K/V there.

Ownership is the caller's: a slot returned by `alloc_*` belongs to exactly one request or to the
radix cache until it is passed back to `free`. Allocation and free are tensor slices on a stack of
free pages — no per-token Python loop. The page is also the unit every caller charges KV in
(`free_pages`, `pages_for`): admission, chunking, decode growth and retraction count pages.

A page freed twice would sit twice on the free stack and be handed to two owners. `free` checks
every page against a free mask: with `debug` it raises `KVDoubleFree`; otherwise it drops the
page, counts it in `double_frees` (exported as a metric) and carries on.
"""

from __future__ import annotations

import torch

from radixpool.worker.device_copy import to_device


class KVDoubleFree(RuntimeError):
    """A KV page was freed while already free (an ownership bug in the caller)."""


def pages_for(kv_len: int, extend: int, page_size: int) -> int:
    """New pages a request holding `kv_len` tokens takes to grow by `extend` tokens (its last
    page's remaining room is used first)."""
    return -(-(kv_len + extend) // page_size) - -(-kv_len // page_size)


def tokens_within(kv_len: int, num_pages: int, page_size: int) -> int:
    """Tokens a request holding `kv_len` tokens can grow by within `num_pages` new pages."""
    return max(0, -(-kv_len // page_size) * page_size + num_pages * page_size - kv_len)


class KVPool:
    def __init__(self, capacity_tokens: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 debug: bool = False) -> None:
        self.page_size = page_size
        self.num_pages = max(1, capacity_tokens // page_size)
        self.capacity = self.num_pages * page_size
        self.device = torch.device(device)
        self.dtype = dtype
        shape = ((self.num_pages + 1) * page_size, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Stack of free page ids; the live part is _free_pages[:_num_free].
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=device)
        self._num_free = self.num_pages
        self._is_free = torch.ones(self.num_pages + 1, dtype=torch.bool, device=device)
        self._is_free[0] = False  # the padding page is never free, so never freed
        self.debug = debug
        self.double_frees = 0

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def available_size(self) -> int:
        """Free tokens (whole free pages)."""
        return self._num_free * self.page_size

    @property
    def free_pages(self) -> int:
        return self._num_free

    def _alloc_pages(self, n: int) -> torch.Tensor | None:
        if n > self._num_free:
            return None
        self._num_free -= n
        pages = self._free_pages[self._num_free:self._num_free + n].clone()
        # (index_fill_: a Python value assigned through an index is first copied, a device sync)
        self._is_free.index_fill_(0, pages, False)
        return pages

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for `num_tokens` tokens that start on a fresh page (None if they do not fit)."""
        num_pages = -(-num_tokens // self.page_size)
        pages = self._alloc_pages(num_pages)
        if pages is None:
            return None
        if self.page_size == 1:
            return pages
        offsets = torch.arange(self.page_size, device=self.device)
        return (pages[:, None] * self.page_size + offsets).flatten()[:num_tokens]

    def alloc_extend(self, prefix_lens: list[int], extend_lens: list[int],
                     last_slots: list[int]) -> torch.Tensor | None:
        """Slots for extending each request by `extend_lens[i]` tokens after `prefix_lens[i]`.

        `last_slots[i]` is the slot of the request's token at `prefix_lens[i] - 1` (ignored when
        the prefix is empty or page-aligned): its page's remaining room is used first.
        Returns all slots concatenated in request order, or None if they do not fit.
        """
        total = sum(extend_lens)
        if self.page_size == 1:
            return self.alloc(total)
        ps = self.page_size
        room = [(ps - p % ps) % ps if p else 0 for p in prefix_lens]
        fresh = [max(0, e - r) for e, r in zip(extend_lens, room)]
        pages = self._alloc_pages(sum(-(-f // ps) for f in fresh))
        if pages is None:
            return None
        offsets = torch.arange(ps, device=self.device)
        page_slots = (pages[:, None] * ps + offsets).flatten()
        parts, cursor = [], 0
        for extend, r, f, last in zip(extend_lens, room, fresh, last_slots):
            in_page = min(extend, r)
            if in_page:
                parts.append(torch.arange(last + 1, last + 1 + in_page, device=self.device))
            if f:
                parts.append(page_slots[cursor:cursor + f])
                cursor += -(-f // ps) * ps
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(parts)

    def alloc_decode(self, seq_lens: list[int], last_slots: torch.Tensor) -> torch.Tensor | None:
        """One slot per request: after `last_slots[i]` in its page, or on a new page.

        `seq_lens[i]` is the request's KV length before this token (its new token's position),
        on the host: which requests need a page is decided without reading the device.
        """
        if self.page_size == 1:
            return self.alloc(len(seq_lens))
        need_page = [n % self.page_size == 0 for n in seq_lens]
        pages = self._alloc_pages(sum(need_page))
        if pages is None:
            return None
        out = last_slots + 1
        if pages.numel():   # positions as integers: a boolean mask index would sync
            lanes = [i for i, need in enumerate(need_page) if need]
            out[to_device(lanes, torch.int64, self.device)] = pages * self.page_size
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return slots. With pages, every page touched must be wholly owned by the caller."""
        if slots.numel() == 0:
            return
        pages = slots if self.page_size == 1 else slots // self.page_size
        unique = torch.unique(pages)
        already = self._is_free[unique]
        repeated = pages.numel() - unique.numel() if self.page_size == 1 else 0
        if repeated or bool(already.any()):
            bad = int(already.sum()) + repeated
            if self.debug:
                raise KVDoubleFree(f"{bad} KV page(s) freed twice: already free, or listed "
                                   f"twice in one free (pages {unique[already].tolist()[:8]})")
            self.double_frees += bad
            unique = unique[~already]
        n = unique.numel()
        self._free_pages[self._num_free:self._num_free + n] = unique
        self._is_free.index_fill_(0, unique, True)
        self._num_free += n

    def first_nonfinite(self, slots: torch.Tensor) -> int | None:
        """Index in `slots` of the first one whose K or V holds a NaN or an infinity in any
        layer, or None. Reads every layer: for a request whose logits went non-finite only."""
        if slots.numel() == 0:
            return None
        bad = torch.zeros(slots.numel(), dtype=torch.bool, device=self.device)
        for buffers in (self.k_buffers, self.v_buffers):
            for layer in buffers:
                bad |= ~torch.isfinite(layer[slots]).flatten(1).all(dim=1)
        found = bad.nonzero()
        return int(found[0]) if found.numel() else None

    def free_slots_set(self) -> set[int]:
        """Every free slot (for invariant checks only: O(capacity))."""
        pages = self._free_pages[:self._num_free].tolist()
        ps = self.page_size
        return {p * ps + i for p in pages for i in range(ps)}


class ReqToTokenPool:
    """Rows of token-slot indices, one row per running request: row[i] = slot of token i.

    `last_token[row]` is the row's latest sampled token, written on the device by the sampler:
    the next decode step reads its input from there, so the host need not have seen it yet.
    """

    def __init__(self, num_rows: int, max_context_len: int, device: torch.device | str) -> None:
        self.table = torch.zeros((num_rows, max_context_len), dtype=torch.int64, device=device)
        self.last_token = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def num_free(self) -> int:
        return len(self._free_rows)
