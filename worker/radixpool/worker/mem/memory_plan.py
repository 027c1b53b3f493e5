"""Sizing the KV pool from a memory fraction, with every other tensor reserved first.

`mem_fraction` of the accelerator memory still free once the weights are loaded is the budget:
the per-request tensors (the request→token table, the penalty counts, the sampler's per-step
buffers at a full batch), the activations of the largest step, and the CUDA graphs' memory are
taken out of it *first*, and the KV pool gets the rest, in whole pages. The remaining
`1 - mem_fraction` is slack for the allocator's fragmentation and the CUDA context. A full batch
therefore never runs out of memory because something grew after the KV cache took its share (the
penalty counts never grow past `penalty_rows`). When nothing is left for the KV cache, the error
lists every reservation so the user sees what did not fit. A pool sized outright
(`kv_cache_tokens`) must leave the same reservations free, or the worker refuses to start
(`check_kv_tokens_fit`), rather than fail at its first long prefill.

On CPU the same reservations are checked against the host memory the worker may still take
(`host_memory`: the container's memory limit, else the host's available memory): the pool's pages
are only touched as the cache fills, so a pool too large would start and the worker be killed
for memory hours later. The default pool shrinks to fit (`cpu_kv_tokens`); one given outright is
refused.
"""

from __future__ import annotations

from dataclasses import dataclass

# Float32 [batch, vocab] buffers a sampling step may hold at once: the logits, the log-softmax for
# logprobs, and the Gumbel noise / candidate scores.
SAMPLER_VOCAB_BUFFERS = 3
INT64_BYTES, FLOAT32_BYTES, BOOL_BYTES, INT32_BYTES = 8, 4, 1, 4
# The part of the host memory left to a CPU worker that its default KV pool may take: the rest is
# for the HTTP process, the tokenizer and the allocator's slack.
CPU_MEM_FRACTION = 0.8
GIB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that its weights and activations follow."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    q_size: int           # num_heads * head_dim
    kv_size: int          # num_kv_heads * head_dim
    tied_embeddings: bool
    itemsize: int         # bytes per weight / activation element

    @property
    def weight_bytes(self) -> int:
        """Every parameter (biases and norms included approximately: they are < 0.1 %)."""
        h, layer = self.hidden_size, 0
        layer += h * (self.q_size + 2 * self.kv_size) + self.q_size * h   # qkv, o
        layer += 3 * h * self.intermediate_size                           # gate, up, down
        layer += 2 * h                                                     # two norms
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.itemsize * (self.num_layers * layer + embeddings + h)

    @property
    def activation_bytes_per_token(self) -> int:
        """An upper bound of what one token keeps alive inside a layer: the residual, the
        normed input, q/k/v, the attention output, the fused gate|up and the activated MLP."""
        h, inter = self.hidden_size, self.intermediate_size
        return self.itemsize * (4 * h + 4 * inter + 2 * self.q_size + 2 * self.kv_size)


@dataclass(frozen=True)
class StepMemory:
    """What a forward step needs beyond the weights and the KV pool."""

    model: ModelShape
    max_step_tokens: int      # the largest step (max_prefill_tokens, or max_running_requests)
    max_batch: int            # logits rows of a step
    graph_batch: int          # largest captured decode batch; 0 without CUDA graphs
    graph_kv_pages: int       # the page-index buffer captured graphs read (0 without graphs)

    @property
    def activation_bytes(self) -> int:
        logits = self.max_batch * self.model.vocab_size * self.model.itemsize
        return self.max_step_tokens * self.model.activation_bytes_per_token + logits

    @property
    def graph_bytes(self) -> int:
        """The graphs share one memory pool, as large as the largest graph's activations."""
        if not self.graph_batch:
            return 0
        return (self.graph_batch * self.model.activation_bytes_per_token
                + self.graph_kv_pages * INT32_BYTES)


@dataclass(frozen=True)
class PerRequestMemory:
    rows: int             # request→token table rows
    context_length: int   # its columns
    vocab_size: int
    penalty_rows: int     # requests whose penalty counts are kept at once
    max_batch: int        # requests sampled in one step

    @property
    def table_bytes(self) -> int:
        return self.rows * self.context_length * INT64_BYTES

    @property
    def penalty_bytes(self) -> int:
        return self.penalty_rows * self.vocab_size * (FLOAT32_BYTES + BOOL_BYTES)

    @property
    def sampler_bytes(self) -> int:
        return self.max_batch * self.vocab_size * FLOAT32_BYTES * SAMPLER_VOCAB_BUFFERS

    @property
    def total_bytes(self) -> int:
        return self.table_bytes + self.penalty_bytes + self.sampler_bytes


def _reservations(per_request: PerRequestMemory, step: StepMemory | None) -> dict[str, int]:
    """What the device must hold beside the KV pool, by what the user can change to shrink it."""
    reserved = {"per-request tensors (max_running_requests, context_length)":
                per_request.total_bytes}
    if step is not None:
        reserved["step activations (max_prefill_tokens, max_running_requests)"] = \
            step.activation_bytes
        if step.graph_bytes:
            reserved["decode CUDA graphs (--disable-cuda-graph to drop)"] = step.graph_bytes
    return reserved


def _listing(reserved: dict[str, int]) -> str:
    return ", ".join(f"{name} {size / GIB:.2f} GiB" for name, size in reserved.items())


def _whole_pages(budget: int, reserved: dict[str, int], kv_bytes_per_token: int,
                 page_size: int) -> int:
    """KV tokens, in whole pages, that `budget` bytes hold once `reserved` is taken out."""
    tokens = max(0, budget - sum(reserved.values())) // kv_bytes_per_token
    return tokens - tokens % page_size


def kv_tokens_for_memory(free_bytes: int, mem_fraction: float, kv_bytes_per_token: int,
                         per_request: PerRequestMemory, page_size: int,
                         step: StepMemory | None = None) -> int:
    """KV tokens (whole pages) that fit in `mem_fraction` of `free_bytes` once the per-request
    tensors, the step's activations and the CUDA graphs are reserved."""
    reserved = _reservations(per_request, step)
    tokens = _whole_pages(int(free_bytes * mem_fraction), reserved, kv_bytes_per_token,
                          page_size)
    if tokens < page_size:
        raise ValueError(
            f"mem_fraction {mem_fraction} of {free_bytes / GIB:.2f} GiB free leaves no room for "
            f"one KV page ({page_size * kv_bytes_per_token / GIB:.3f} GiB) after "
            f"{_listing(reserved)}: "
            f"raise mem_fraction or lower max_running_requests / context_length / "
            f"max_prefill_tokens")
    return tokens


def check_weights_fit(weight_bytes: int, free_bytes: int, where: str) -> None:
    """A clear error, before allocating, when the weights alone exceed the free memory."""
    if weight_bytes > free_bytes:
        raise MemoryError(f"the model's weights ({weight_bytes / GIB:.2f} GiB) do not fit in "
                          f"the {free_bytes / GIB:.2f} GiB free on {where}: use a smaller "
                          f"model, a smaller --dtype, or a larger device")


def check_kv_tokens_fit(tokens: int, free_bytes: int, kv_bytes_per_token: int,
                        per_request: PerRequestMemory, page_size: int, step: StepMemory,
                        host: HostMemory | None = None) -> None:
    """A KV pool of `tokens` given outright (`kv_cache_tokens`) must leave room for what every
    step needs beside it: one that takes it all starts, then fails at its first long prefill
    (the device runs out mid-step and every request in flight is lost). On CPU (`host`), the
    pool's pages are only touched as the cache fills, so one too large starts and the worker
    is killed for memory hours later. Raises ValueError naming the largest pool that fits."""
    reserved = _reservations(per_request, step)
    need = tokens * kv_bytes_per_token + sum(reserved.values())
    if need <= free_bytes:
        return
    most = _whole_pages(free_bytes, reserved, kv_bytes_per_token, page_size)
    where = "free after the weights" if host is None else f"that {host.bound} leaves"
    other = ("size the pool with mem_fraction" if host is None
             else "lower max_running_requests / context_length / max_prefill_tokens")
    raise ValueError(
        f"kv_cache_tokens {tokens} ({tokens * kv_bytes_per_token / GIB:.2f} GiB) and what a step "
        f"needs beside it ({_listing(reserved)}) come to {need / GIB:.2f} GiB, more than the "
        f"{free_bytes / GIB:.2f} GiB {where}: set kv_cache_tokens to at most {most}, or "
        f"{other}")


def cpu_kv_tokens(default: int, host: HostMemory, kv_bytes_per_token: int,
                  per_request: PerRequestMemory, page_size: int, step: StepMemory) -> int:
    """The CPU's default pool (`default` tokens), shrunk to fit in `CPU_MEM_FRACTION` of what
    `host` leaves once the per-request tensors and the step's activations are reserved (a
    small container). Raises ValueError when not one page fits."""
    reserved = _reservations(per_request, step)
    most = _whole_pages(int(host.free_bytes * CPU_MEM_FRACTION), reserved, kv_bytes_per_token,
                        page_size)
    if most < page_size:
        raise ValueError(
            f"{CPU_MEM_FRACTION} of the {host.free_bytes / GIB:.2f} GiB that {host.bound} "
            f"leaves holds no KV page ({page_size * kv_bytes_per_token / GIB:.3f} GiB) after "
            f"{_listing(reserved)}: give the worker more memory, or lower max_running_requests "
            f"/ context_length / max_prefill_tokens")
    return min(default, most)


@dataclass(frozen=True)
class HostMemory:
    """The host memory a CPU worker may still take, and what bounds it."""

    free_bytes: int
    bound: str   # "the container's memory limit" or "the host's available memory"


# A cgroup v1 limit this large (2^63 rounded down to a page) means none.
CGROUP_V1_UNLIMITED = 1 << 62


def host_memory(cgroup_root: str = "/sys/fs/cgroup", meminfo: str = "/proc/meminfo"
                ) -> HostMemory | None:
    """What this process may still take: the lower of the host's MemAvailable and, in a
    container with a memory limit (cgroup v2 `memory.max`, or v1 `memory.limit_in_bytes`), that
    limit less the container's anonymous memory. Page cache is left out of the use, as the
    kernel reclaims it before the limit kills anything. None when neither can be read."""
    found: list[HostMemory] = []
    available = _field(_read(meminfo), "MemAvailable:")
    if available is not None:
        found.append(HostMemory(available * 1024, "the host's available memory"))
    for limit_file, stat_file, anon_field in (
            ("memory.max", "memory.stat", "anon"),
            ("memory/memory.limit_in_bytes", "memory/memory.stat", "total_rss")):
        limit_text = _read(f"{cgroup_root}/{limit_file}")
        if limit_text is None:
            continue
        if limit_text.strip().isdigit() and int(limit_text) < CGROUP_V1_UNLIMITED:
            anon = _field(_read(f"{cgroup_root}/{stat_file}"), anon_field) or 0
            found.append(HostMemory(max(0, int(limit_text) - anon),
                                    "the container's memory limit"))
        break
    return min(found, key=lambda m: m.free_bytes) if found else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _field(text: str | None, name: str) -> int | None:
    """The number after `name` on its line of a /proc/meminfo- or memory.stat-style file."""
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == name and parts[1].isdigit():
            return int(parts[1])
    return None
