"""The demo's traffic, as data: which conversations to hold and in what order.

Two kinds of job, interleaved deterministically so every policy sees the same sequence:
- shared prefix: many single questions under a few long system prompts (a support bot, a RAG
  template) — whoever already computed a group's system prompt can skip it;
- multi-turn: conversations whose every turn resends the whole history plus the model's last
  answer — the worker that served turn t holds turns 1..t in its cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SHARED_PREFIX = "shared prefix"
MULTI_TURN = "multi-turn"

_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
    "from", "it", "an", "were", "are", "which", "this", "be", "or", "has", "had", "not",
    "first", "one", "their", "its", "new", "after", "but", "who", "they", "been", "have",
    "also", "two", "time", "year", "city", "school", "world", "group", "music", "state",
    "house", "water", "light", "river", "stone", "paper", "cache", "token", "prefix", "model",
    "serve", "request", "worker", "gateway", "radix", "tree", "memory", "batch", "stream",
    "route", "cluster", "pool", "node", "page", "block", "queue", "prompt", "answer",
    "question", "system", "user", "kernel", "graph", "tensor", "layer", "attention",
)


@dataclass(frozen=True)
class Job:
    """One client session: a system prompt and the user turns sent one after another."""

    kind: str
    system: str
    turns: tuple[str, ...]
    max_tokens: int


@dataclass(frozen=True)
class WorkloadShape:
    groups: int = 12              # shared-prefix system prompts
    questions: int = 32           # questions per group
    system_words: int = 1000      # length of each system prompt (about one token per word)
    conversations: int = 12
    turns: int = 6
    context_words: int = 600      # a conversation's own opening context
    turn_words: int = 32
    answer_tokens: int = 8
    seed: int = 0

    @property
    def requests(self) -> int:
        return self.groups * self.questions + self.conversations * self.turns


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def demo_jobs(shape: WorkloadShape) -> list[Job]:
    """Every job of the workload, in the order clients start them."""
    rng = random.Random(shape.seed)
    systems = [f"You are assistant {g}. " + _text(rng, shape.system_words)
               for g in range(shape.groups)]
    shared = [Job(SHARED_PREFIX, systems[g], (f"Question {q}: {_text(rng, 8)}?",),
                  shape.answer_tokens)
              for q in range(shape.questions) for g in range(shape.groups)]
    conversations = [
        Job(MULTI_TURN, f"Conversation {c}. Context: " + _text(rng, shape.context_words),
            tuple(f"Turn {t}: {_text(rng, shape.turn_words)}" for t in range(shape.turns)),
            shape.answer_tokens)
        for c in range(shape.conversations)]
    # Conversations start spread over the run, between rounds of questions.
    jobs = list(shared)
    step = max(len(shared) // max(shape.conversations, 1), 1)
    for i, conv in enumerate(conversations):
        jobs.insert(min(i * step + i, len(jobs)), conv)
    return jobs
