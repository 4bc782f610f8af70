"""The requests of the Ray pool soak (``benchmarks/soak_pool.py``): arrivals at random, admission
against the KV pages, preemption when a step would not fit, completion.

It keeps only the book of requests; the soak runs the pool and the checks. ``counts`` is the soak's
dict of counters: ``arrived``, ``preempted``, ``requeued`` and ``completed`` move here.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Req", "Traffic"]


@dataclass
class Req:
    """One request of the traffic: prompt and generation lengths, and how far it got."""

    id: int
    prompt: int
    gen: int
    prefilled: int = 0
    generated: int = 0

    @property
    def length(self) -> int:
        return self.prefilled + self.generated

    @property
    def final(self) -> int:
        return self.prompt + self.gen


class Traffic:
    """Waiting and admitted requests of one soak run.

    Args:
        rng: the soak's random source (the traffic is a function of its seed).
        cfg: the pool's ``KVCacheConfig`` (``max_requests``, ``num_pages``, ``pages_for``).
        max_seq_len: the longest request (prompt + generated).
        overcommit: admit requests while their final lengths need up to this x the pages.
        counts: the soak's counters, updated in place.
    """

    def __init__(self, rng: random.Random, cfg: Any, max_seq_len: int, overcommit: float, counts: dict[str, int]):
        self.rng, self.cfg, self.counts = rng, cfg, counts
        self.max_seq_len, self.overcommit = max_seq_len, overcommit
        self.waiting: list[Req] = []
        self.active: dict[int, Req] = {}  # admitted: the pool holds KV state for those with tokens
        self.next_id = 0

    def arrive(self) -> None:
        """New requests at random (0-2 a step), while no more than ``max_requests`` wait (a service's
        admission queue pushes back on its clients)."""
        if len(self.waiting) >= self.cfg.max_requests:
            return
        for _ in range(self.rng.choice((0, 0, 1, 1, 2))):
            prompt = self.rng.randint(4, 64)
            gen = self.rng.randint(1, min(24, self.max_seq_len - prompt))
            self.waiting.append(Req(self.next_id, prompt, gen))
            self.next_id += 1
            self.counts["arrived"] += 1

    def reserved_pages(self) -> int:
        """Pages the admitted requests need at their final lengths."""
        return sum(self.cfg.pages_for(r.final) for r in self.active.values())

    def admit(self) -> None:
        """Admit waiting requests while their final lengths fit ``overcommit`` x the pages: the cache
        runs near capacity, and a step that would not fit preempts a request (:meth:`make_room`)."""
        budget = int(self.overcommit * int(self.cfg.num_pages)) - self.reserved_pages()
        while self.waiting and len(self.active) < self.cfg.max_requests:
            need = self.cfg.pages_for(self.waiting[0].final)
            if need > budget:
                break
            r = self.waiting.pop(0)
            self.active[r.id] = r
            budget -= need

    def held(self) -> set[int]:
        """Requests the pool holds KV state for (prefilled at least one token)."""
        return {i for i, r in self.active.items() if r.prefilled > 0}

    def requeue(self, req: Req) -> None:
        """Serve ``req``'s lengths again from the start, as a new request at the head of the queue."""
        self.waiting.insert(0, Req(self.next_id, req.prompt, req.gen))
        self.next_id += 1

    def make_room(
        self, step: list[tuple[Req, int]], free_pages: Callable[[], int], free: Callable[[int], None]
    ) -> list[tuple[Req, int]]:
        """Free pages for a step adding ``n`` tokens to each ``(request, n)``: preempt held requests
        outside the step, newest first (``free(id)`` releases one; it is served again later as a new
        request); drop the step's last requests when that is not enough. ``free_pages()``: the
        pool's free pages now. Returns the step that fits (maybe empty)."""
        pages = self.cfg.pages_for
        while step:
            need = sum(pages(r.length + n) - pages(r.length) for r, n in step)
            if need <= free_pages():
                return step
            inside = {r.id for r, _ in step}
            others = [i for i in self.held() if i not in inside]
            if not others:
                step = step[:-1]
                continue
            victim = self.active.pop(max(others))
            free(victim.id)
            self.requeue(victim)
            self.counts["preempted"] += 1
        return step

    def prefill_chunks(self) -> list[tuple[Req, int]]:
        """1-3 admitted requests with prompt left, each with a random chunk of it (128 tokens in all)."""
        todo = [r for r in self.active.values() if r.prefilled < r.prompt]
        self.rng.shuffle(todo)
        chunks, budget = [], 128
        for r in todo[: self.rng.randint(1, 3)] if todo else []:
            n = min(r.prompt - r.prefilled, self.rng.randint(8, 64), budget)
            if n <= 0:
                break
            chunks.append((r, n))
            budget -= n
        return chunks

    def decode_batch(self) -> list[tuple[Req, int]]:
        """1-16 prefilled requests with tokens left to generate, each with 1 or 2 query tokens (32 in all)."""
        ready = [r for r in self.active.values() if r.prefilled == r.prompt and r.generated < r.gen]
        self.rng.shuffle(ready)
        batch, tokens = [], 0
        for r in ready[: self.rng.randint(1, 16)] if ready else []:
            q_len = min(self.rng.choice((1, 1, 1, 2)), r.gen - r.generated)
            if tokens + q_len > 32:
                break
            batch.append((r, q_len))
            tokens += q_len
        return batch

    def take_done(self) -> list[int]:
        """Remove and return the requests that have generated all their tokens."""
        done = [i for i, r in self.active.items() if r.prefilled == r.prompt and r.generated >= r.gen]
        for i in done:
            del self.active[i]
        self.counts["completed"] += len(done)
        return done
