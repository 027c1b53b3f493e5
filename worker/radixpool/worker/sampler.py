"""Token selection for a batch of requests that each bring their own sampling parameters.

One step, each stage a batched tensor op over the rows that need it:
  1. logprobs, when a row asks, from the model's *unmodified* distribution, log_softmax(logits):
     what the model believed, before penalties, bias, masks, temperature or truncation (the
     convention of the OpenAI API and of vLLM's default); a token the filters allowed but the
     model found unlikely shows up as such.
  2. repetition / frequency / presence penalties (penalties.py), logit_bias, the min_new_tokens
     ban on eos and stop_token_ids, then `vocab_mask` (grammars: False = not allowed, for the
     rows in `mask_rows`; a masked row left with no allowed token at all gets the first eos id).
  3. greedy rows (temperature 0, below GREEDY_TEMPERATURE, or top_k 1): argmax.
  4. sampled rows: logits / temperature; top-k, then top-p over the top-k renormalised
     distribution, then min-p (the Hugging Face order); then Gumbel-max over the kept tokens.
When every row is plain greedy (nothing above applies) a step is a single argmax.

Randomness is counter-based, not a torch RNG: token v of a row gets the uniform
hash(seed, step = len(output_ids), v), so a row's token depends only on its own logits, params,
seed and step, never on what else is in the batch or where the row sits. Gumbel-max keyed by
token id also makes the result independent of how many top-k candidates the batch gathered, so
rows are free to take the cheap candidate path or the full-vocabulary path. A request resumed
after retraction replays the same randomness. The low 64 bits of the seed count. The promise is
for the same logits: exact float ties between tokens, and a top-p boundary that the rounding of a
batched sum could move, are the only places a batch could matter (the model's own logits may of
course differ with the batch on a GPU).

Non-finite logits (NaN, +inf, or nothing but -inf: fp16 overflow, a bad checkpoint, a kernel
bug) would draw garbage, NaN included, and give NaN logprobs. A row is flagged when the token it
drew has a non-finite (edited) logit, which argmax makes so whenever a NaN or +inf survived the
edits, or, in a row that asks for logprobs, when the token's logprob is not finite (any NaN or
+inf in the model's row); never a row a grammar mask left with nothing allowed. A flagged row's
token is NONFINITE (an impossible id): the flag travels with the tokens and is read when they
are, with no pass over [n, V] of its own and no extra wait for the device.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from radixpool.worker.device_copy import to_device
from radixpool.worker.penalties import PenaltyState, one_call_key
from radixpool.worker.sampling_params import SamplingParams

NONFINITE = -1   # the token of a row whose logits were not finite
TOP_P_CANDIDATES = 1024    # top-p without top-k first looks at this many tokens (then 8x more)
_MASK32 = 0xFFFFFFFF
_TOKEN_MULTIPLIER = 0x61C88647  # 2^32 / golden ratio, odd: spreads consecutive token ids


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int                     # the row's effective seed: see `request_seed`
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]     # tokens generated so far; len() is the step
    key: Hashable | None = None   # request id: lets penalty counts persist between steps
    # The step when it differs from len(output_ids): tokens still on the device count too.
    generated: int | None = None

    @property
    def step(self) -> int:
        return len(self.output_ids) if self.generated is None else self.generated


@dataclass
class SampleResult:
    token_ids: list[int] | None   # None when the caller asked to keep the tokens on the device
    # Present when any row asked for logprobs; None for rows that did not.
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    tensor: torch.Tensor | None = None   # the same tokens, on the device
    # On the device, what a row's next step may read as its input: `tensor` without the
    # NONFINITE flags (the request ends when the flag is read, the step after it is dropped).
    inputs: torch.Tensor | None = None


def request_seed(seed: int | None, fork: int = 0) -> int:
    """`SamplingRow.seed` for choice `fork` (0 .. n-1) of a request.

    A request's own seed is kept for fork 0 and mixed with the fork index for the others, so n
    choices differ yet replay; a request without a seed gets a fresh random one.
    """
    if seed is None:
        return secrets.randbits(64)
    if fork == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{fork}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mix (Wellons' `hash32`) on int64 tensors holding values in [0, 2^32).

    Both multipliers are below 2^31, so no product leaves int64: the result is exact on every
    device. Works in place on `x`, which must be a fresh tensor.
    """
    x ^= x >> 15
    x.mul_(0x2C1B3C6D).bitwise_and_(_MASK32)
    x ^= x >> 12
    x.mul_(0x297A2D39).bitwise_and_(_MASK32)
    x ^= x >> 15
    return x


_BELOW_ONE = 1.0 - 2.0 ** -24   # the largest float32 below 1


def _gumbel(token_keys: torch.Tensor, row_keys: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise from per-token keys [.., V] and per-row keys [n, 1].

    The noise is -log(e) with e = -log(u) and u = (h + 0.5) / 2^32 for the token's 32-bit hash h.
    The token that wins a draw has u within about 1/V of 1, where float32 holds u itself only to
    2^-24; so e is computed as -log1p(-(1 - u)), and 1 - u = (2^32 - 1 - h + 0.5) / 2^32, small,
    keeps all 32 bits. (From u alone every hash in the top 2^-24 got the one noise 16.6: a token
    more than ~17 nats below the top one was never drawn, which at V = 151,936 took up to 0.3%
    of the draws from a long tail.) The clamp keeps 1 - u below 1: a noise of -inf plus a +inf
    logit would be NaN, which argmax takes.
    """
    tail = _hash32(token_keys ^ row_keys).neg_().add_(_MASK32)   # 2^32 - 1 - h
    w = tail.to(torch.float32).add_(0.5).mul_(2.0 ** -32).clamp_(max=_BELOW_ONE)
    return w.neg_().log1p_().neg_().log_().neg_()


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] | int,
                 device: torch.device | str = "cpu", max_penalty_requests: int = 1024,
                 preallocate: bool = False) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = ((eos_token_ids,) if isinstance(eos_token_ids, int)
                              else tuple(eos_token_ids))
        self.device = torch.device(device)
        ids = torch.arange(vocab_size, dtype=torch.long, device=self.device)
        self._positions = ids
        self._vocab_keys = (ids * _TOKEN_MULTIPLIER).bitwise_and_(_MASK32)
        self._minus_inf = torch.tensor(-math.inf, device=self.device)
        self._penalties = PenaltyState(vocab_size, self.device, max_penalty_requests,
                                       preallocate)

    def release(self, key: Hashable) -> None:
        """Forget a finished or aborted request's penalty counts."""
        self._penalties.release(key)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
               vocab_mask: torch.Tensor | None = None,
               logits_owned: bool = False, to_host: bool = True,
               mask_rows: Sequence[int] | None = None) -> SampleResult:
        """Pick one token per row. `logits` [len(rows), vocab_size] is not modified unless
        `logits_owned` (the caller will not read them again: no copy is made to edit them).
        Without `to_host` the tokens stay on the device (`tensor`) unless logprobs are asked.
        `vocab_mask` [len(mask_rows), vocab_size] (or [len(rows), ...] without `mask_rows`)."""
        n, vocab = len(rows), self.vocab_size
        if logits.shape != (n, vocab):
            raise ValueError(f"logits must be [{n}, {vocab}], got {list(logits.shape)}")
        owned = logits_owned or logits.dtype != torch.float32  # a float32 copy is ours too
        logits = logits.float()
        greedy: list[int] = []
        sampled: list[int] = []
        penalised: list[int] = []
        want_logprobs: list[int] = []
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if p.greedy:
                greedy.append(i)
            else:
                sampled.append(i)
            if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty:
                penalised.append(i)
            if p.logprobs is not None:
                want_logprobs.append(i)
            if p.logit_bias:
                bias_rows.extend([i] * len(p.logit_bias))
                bias_tokens.extend(p.logit_bias)
                bias_values.extend(p.logit_bias.values())
            if row.step < p.min_new_tokens:
                banned = p.stop_token_ids if p.ignore_eos else self.eos_token_ids + p.stop_token_ids
                ban_rows.extend([i] * len(banned))
                ban_tokens.extend(banned)

        modifies = bool(penalised or bias_rows or ban_rows) or vocab_mask is not None
        if not (sampled or modifies or want_logprobs):
            tokens = logits.argmax(-1)
            return self._flagged(tokens, self._nonfinite(logits, tokens), to_host)

        logprobs = None
        if want_logprobs:
            logprobs = torch.log_softmax(self._take(logits, want_logprobs, n), dim=-1)
        work = logits.clone() if modifies and not owned else logits
        if penalised:
            self._apply_penalties(work, rows, penalised)
        if bias_rows:
            index = (self._long(bias_rows), self._long(bias_tokens))
            work.index_put_(index, to_device(bias_values, torch.float32, self.device),
                            accumulate=True)
        if ban_rows:
            work.index_put_((self._long(ban_rows), self._long(ban_tokens)), self._minus_inf)
        if vocab_mask is not None:
            if mask_rows is None or len(mask_rows) == n:
                work.masked_fill_(vocab_mask.logical_not(), -math.inf)
            else:
                index = self._long(mask_rows)
                work[index] = work[index].masked_fill_(vocab_mask.logical_not(), -math.inf)

        if not sampled:
            tokens = work.argmax(-1)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=self.device)
            if greedy:
                tokens[self._long(greedy)] = self._take(work, greedy, n).argmax(-1)
            chosen = self._sample_rows(self._take(work, sampled, n), [rows[i] for i in sampled])
            if greedy:
                tokens[self._long(sampled)] = chosen
            else:
                tokens = chosen
        bad = self._nonfinite(work, tokens)
        dead = None
        if vocab_mask is not None and self.eos_token_ids:
            # A row the mask left with no token at all (a grammar that has ended) gets eos.
            dead = work.amax(-1) == -math.inf
            tokens = tokens.masked_fill(dead, self.eos_token_ids[0])
            bad &= dead.logical_not()
        if logprobs is None:
            return self._flagged(tokens, bad, to_host)
        return self._with_logprobs(tokens, bad, dead, logprobs, rows, want_logprobs)

    @staticmethod
    def _nonfinite(work: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Rows whose drawn token has a non-finite logit in `work`: n values read, not n * V."""
        return torch.isfinite(work.gather(1, tokens.unsqueeze(1)).squeeze(1)).logical_not_()

    @staticmethod
    def _flagged(tokens: torch.Tensor, bad: torch.Tensor, to_host: bool) -> SampleResult:
        flagged = tokens.masked_fill(bad, NONFINITE)
        return SampleResult(flagged.tolist() if to_host else None, tensor=flagged, inputs=tokens)

    def _long(self, values: Sequence[int]) -> torch.Tensor:
        return to_device(values, torch.long, self.device)

    def _take(self, x: torch.Tensor, index: list[int], n: int) -> torch.Tensor:
        return x if len(index) == n else x[self._long(index)]  # (faster than index_select on CPU)

    def _apply_penalties(self, work: torch.Tensor, rows: Sequence[SamplingRow],
                         index: list[int]) -> None:
        chosen = [rows[i] for i in index]
        factors = to_device(
            [(r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty)
             for r in chosen], torch.float32, self.device)
        keys = [one_call_key() if r.key is None else r.key for r in chosen]
        self._penalties.apply(work, index, keys, [r.prompt_ids for r in chosen],
                              [r.output_ids for r in chosen], factors)

    def _sample_rows(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Sample one token per row of (already penalised and masked) logits x [m, V]."""
        vocab = self.vocab_size
        top_k: list[int] = []
        floats: list[tuple[float, float, float]] = []
        ints: list[tuple[int, int, int, int]] = []
        truncated: list[int] = []
        whole: list[int] = []
        for j, r in enumerate(rows):
            p = r.params
            k = p.top_k if 0 < p.top_k < vocab else vocab
            top_k.append(k)
            floats.append((p.temperature, p.top_p if p.top_p < 1 else math.inf,
                           math.log(p.min_p) if p.min_p > 0 else -math.inf))
            ints.append((k, r.seed & _MASK32, (r.seed >> 32) & _MASK32,
                         r.step & _MASK32))
            (truncated if k < vocab or p.top_p < 1 else whole).append(j)
        floats_t = to_device(floats, torch.float32, self.device)
        ints_t = to_device(ints, torch.long, self.device)
        x = x / floats_t[:, 0:1]
        keys = _hash32(ints_t[:, 3] ^ 0x9E3779B9)
        keys = _hash32(keys ^ ints_t[:, 2])
        keys = _hash32(keys ^ ints_t[:, 1]).unsqueeze(1)

        if not truncated:
            return self._sample_full(x, keys, floats_t[:, 2:3], rows)
        if not whole:
            return self._sample_candidates(x, keys, ints_t[:, 0], floats_t[:, 1:3], top_k)
        out = torch.empty(len(rows), dtype=torch.long, device=self.device)
        t_idx, w_idx = self._long(truncated), self._long(whole)
        out[t_idx] = self._sample_candidates(x[t_idx], keys[t_idx], ints_t[t_idx, 0],
                                             floats_t[t_idx, 1:3], [top_k[j] for j in truncated])
        out[w_idx] = self._sample_full(x[w_idx], keys[w_idx], floats_t[w_idx, 2:3],
                                       [rows[j] for j in whole])
        return out

    def _sample_full(self, x: torch.Tensor, keys: torch.Tensor, log_min_p: torch.Tensor,
                     rows: list[SamplingRow]) -> torch.Tensor:
        """Gumbel-max over the whole vocabulary (min-p is a threshold against the row max)."""
        if any(r.params.min_p > 0 for r in rows):
            floor = x.amax(-1, keepdim=True) + log_min_p
            x = x.masked_fill(x < floor, -math.inf)
        return x.add_(_gumbel(self._vocab_keys, keys)).argmax(-1)

    def _sample_candidates(self, x: torch.Tensor, keys: torch.Tensor, top_k: torch.Tensor,
                           top_p_min_p: torch.Tensor, top_k_list: list[int]) -> torch.Tensor:
        """Gumbel-max over the tokens that survive top-k, top-p and min-p."""
        vocab = self.vocab_size
        top_p = top_p_min_p[:, 0:1]
        top_p_only = any(k == vocab for k in top_k_list)
        width = max((k for k in top_k_list if k < vocab), default=1)
        whole = None
        if top_p_only:
            width = max(width, min(vocab, TOP_P_CANDIDATES))
            whole = torch.logsumexp(x, dim=-1, keepdim=True)
        while True:
            if width < vocab:
                values, ids = x.topk(width, dim=-1)
            else:
                values, ids = x.sort(dim=-1, descending=True)
            if whole is None or width == vocab:
                break
            # A row without top-k keeps tokens past the window if the window holds < top_p.
            mass = (torch.logsumexp(values, dim=-1, keepdim=True) - whole).exp_()
            if not bool(((mass < top_p) & (top_k.unsqueeze(1) >= vocab)).any()):
                break
            width = width * 8 if width * 16 < vocab else vocab
        in_top_k = self._positions[:width] < top_k.unsqueeze(1)
        values = values.masked_fill_(in_top_k.logical_not(), -math.inf)
        # top-p sees the top-k renormalised distribution; rows without top-k the whole one
        log_total = torch.logsumexp(values, dim=-1, keepdim=True)
        if whole is not None:
            log_total = torch.where(top_k.unsqueeze(1) >= vocab, whole, log_total)
        probs = (values - log_total).exp_()
        keep = (probs.cumsum(dim=-1) - probs) < top_p
        keep &= values >= values[:, :1] + top_p_min_p[:, 1:2]
        keep[:, 0] = True
        token_keys = (ids * _TOKEN_MULTIPLIER).bitwise_and_(_MASK32)
        scores = values.add_(_gumbel(token_keys, keys)).masked_fill_(keep.logical_not(),
                                                                     -math.inf)
        return ids.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)

    def _with_logprobs(self, tokens: torch.Tensor, bad: torch.Tensor, dead: torch.Tensor | None,
                       logprobs: torch.Tensor, rows: Sequence[SamplingRow],
                       index: list[int]) -> SampleResult:
        n, m = len(rows), len(index)
        at = self._long(index)
        chosen = logprobs.gather(1, tokens[at].unsqueeze(1)).squeeze(1)
        # a NaN or +inf anywhere in the model's row makes the drawn token's logprob NaN or -inf
        lost = torch.isfinite(chosen).logical_not_()
        if dead is not None:
            lost &= dead[at].logical_not()
        bad.index_put_((at,), bad[at] | lost)
        flagged = tokens.masked_fill(bad, NONFINITE)
        k = min(max(rows[i].params.logprobs for i in index), self.vocab_size)
        parts = [flagged.double(), chosen.double()]
        if k:
            top_values, top_ids = logprobs.topk(k, dim=-1)
            parts += [top_values.double().flatten(), top_ids.double().flatten()]
        flat = torch.cat(parts).tolist()  # one device-to-host transfer
        token_ids = [int(t) for t in flat[:n]]
        chosen_lp = flat[n:n + m]
        top_values_l = flat[n + m:n + m + m * k]
        top_ids_l = flat[n + m + m * k:]
        out_lp: list[float | None] = [None] * n
        out_top: list[list[tuple[int, float]] | None] = [None] * n
        for j, i in enumerate(index):
            want = rows[i].params.logprobs
            out_lp[i] = chosen_lp[j]
            out_top[i] = [(int(top_ids_l[j * k + c]), top_values_l[j * k + c])
                          for c in range(min(want, k))]
        return SampleResult(token_ids, out_lp, out_top, tensor=flagged, inputs=tokens)
