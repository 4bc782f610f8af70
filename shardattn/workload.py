"""Sparse-attention workloads: synthetic top-k indices with tunable neighbour overlap, and dumps.

A DSA indexer scores every earlier token and keeps the ``K`` best. The generator does the same
with scores that are correlated across neighbouring queries::

    score_t(x) = sqrt(rho) * base(x) + sqrt(1 - rho) * noise_t(x),     x <= position of t

``base`` is one random field per request; ``noise_t`` drifts with the query index (between
independent fields drawn every ``drift`` queries, on a quarter circle so its variance stays 1).
High ``rho`` and long ``drift`` give neighbours that pick nearly the same rows; the overlap
falls with position, as measured on DSA models, because more candidates compete for the same
``K`` slots. A query with fewer than ``K`` earlier tokens picks them all (the rest ``-1``).

Presets (:data:`PRESETS`), calibrated with :func:`union_ratio` at 64K context and ``K = 2048``
against published DSA measurements (union of 2 neighbours about 1.15x one list, of 8 about
1.2-1.7x): ``"dsa"`` gives 1.15 / 1.30 / 1.43 at G = 2 / 4 / 8 for queries near position 60K
(1.09 / 1.16 / 1.23 near 8K), ``"dsa_low"`` 1.22 / 1.43 / 1.63 near 60K, and ``"random"``
(independent uniform choices, the worst case for grouping) 1.97 / 3.8 / 7.1.

Recorded dumps load with :func:`load_topk_dump` (``.pt`` or ``.safetensors`` holding ``topk
[T, K]`` int32 and ``valid [T]`` int32, the count of leading valid entries).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shardattn._checks import check_choice, check_int, check_tensor


@dataclass(frozen=True)
class Overlap:
    """Score model of the generator (variances of the three score components sum to 1).

    ``rho``: weight of the request's shared score; ``jitter``: weight of fresh per-query noise;
    the rest drifts, reaching an independent field every ``drift`` queries.
    """

    rho: float
    drift: int
    jitter: float = 0.0


def seeded_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded ``seed`` taken modulo ``2**64``: torch's seeds are 64 bits
    and it reads a negative one as its two's complement, so this is torch's own generator for any
    seed ``torch.manual_seed`` takes, and a seed derived from one (``seed + r``, ``seed * 7919``)
    past that range wraps instead of overflowing.

    >>> a = torch.randn(2, generator=seeded_generator("cpu", -1))
    >>> torch.equal(a, torch.randn(2, generator=seeded_generator("cpu", 2**64 - 1)))
    True
    """
    return torch.Generator(device=device).manual_seed(seed % 2**64)


PRESETS: dict[str, Overlap] = {
    "dsa": Overlap(rho=0.93, drift=128, jitter=0.015),
    "dsa_low": Overlap(rho=0.9, drift=64, jitter=0.03),
    "random": Overlap(rho=0.0, drift=1, jitter=1.0),
}


def _overlap_spec(overlap: object) -> Overlap:
    """``synthetic_topk``'s ``overlap`` checked: a :data:`PRESETS` name or an :class:`Overlap` whose
    ``rho`` and ``jitter`` are real numbers ``>= 0`` summing to at most 1 and ``drift`` an int ``>= 1``."""
    if isinstance(overlap, str):
        check_choice("overlap", overlap, sorted(PRESETS))
        return PRESETS[overlap]
    if not isinstance(overlap, Overlap):
        raise TypeError(f"overlap must be a preset name or an Overlap, got {type(overlap).__name__}")
    for name in ("rho", "jitter"):
        value = getattr(overlap, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"overlap.{name} must be a float, got {type(value).__name__} ({value!r})")
    check_int("overlap.drift", overlap.drift, minimum=1)
    if not (overlap.rho >= 0.0 and overlap.jitter >= 0.0 and overlap.rho + overlap.jitter <= 1.0):
        raise ValueError(f"overlap needs rho, jitter >= 0, rho + jitter <= 1 and drift >= 1, got {overlap}")
    return overlap


def synthetic_topk(
    num_tokens: int,
    topk: int,
    *,
    start_position: int,
    overlap: str | Overlap = "dsa",
    seed: int = 0,
    device: torch.device | str = "cpu",
    chunk: int = 256,
) -> torch.Tensor:
    """Top-k positions of ``num_tokens`` consecutive queries of one request.

    Query ``t`` sits at position ``start_position + t`` and picks among positions
    ``[0, start_position + t]`` (causal).

    Args:
        num_tokens: ``T`` queries. topk: ``K``. start_position: position of the first query.
        overlap: a :data:`PRESETS` name or an :class:`Overlap`.
        seed: random seed (the same seed gives the same indices on the same device type; taken
            modulo ``2**64``, :func:`seeded_generator`).
        device: where to generate (a GPU is much faster for long contexts).
        chunk: queries scored at once (memory ``chunk * context * 4`` bytes).
    Returns:
        ``[T, K]`` int32 request-local positions, sorted per row, ``-1`` padded.

    Example:
        >>> pos = synthetic_topk(6, 4, start_position=2, seed=1)
        >>> pos[0].tolist(), bool((pos[5] >= 0).all()), bool((pos[5] <= 7).all())
        ([0, 1, 2, -1], True, True)
    """
    check_int("num_tokens", num_tokens, minimum=0)
    check_int("topk", topk, minimum=1)
    check_int("start_position", start_position, minimum=0)
    check_int("seed", seed)
    check_int("chunk", chunk, minimum=1)
    spec = _overlap_spec(overlap)
    ctx = start_position + num_tokens
    gen = seeded_generator(device, seed)
    base = torch.randn(ctx, generator=gen, device=device)
    fields: dict[int, torch.Tensor] = {}

    def field(i: int) -> torch.Tensor:
        if i not in fields:
            fields[i] = torch.randn(ctx, generator=seeded_generator(device, seed * 7919 + i + 1), device=device)
            for old in [k for k in fields if k < i - 2]:
                del fields[old]
        return fields[i]

    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=device)
    a, b, c = math.sqrt(spec.rho), math.sqrt(max(0.0, 1.0 - spec.rho - spec.jitter)), math.sqrt(spec.jitter)
    pos_all = torch.arange(ctx, device=device)
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        ts = torch.arange(t0, t1, device=device)
        if b == 0.0:
            noise = torch.zeros(t1 - t0, ctx, device=device)
        else:
            lo = ts // spec.drift
            theta = (ts % spec.drift).float() / spec.drift * (math.pi / 2)
            noise = torch.empty(t1 - t0, ctx, device=device)
            for i in range(int(lo[0]), int(lo[-1]) + 1):
                sel = lo == i
                th = theta[sel][:, None]
                noise[sel] = torch.cos(th) * field(i)[None, :] + torch.sin(th) * field(i + 1)[None, :]
        score = a * base[None, :] + b * noise
        for row in score if c > 0.0 else ():  # a query at a time: the draws do not depend on ``chunk``
            row += c * torch.randn(ctx, generator=gen, device=device)
        limit = start_position + ts  # last allowed position per query
        score.masked_fill_(pos_all[None, :] > limit[:, None], -math.inf)
        k_eff = min(topk, ctx)
        val, idx = score.topk(k_eff, dim=1)
        idx = torch.where(torch.isfinite(val), idx, torch.full_like(idx, -1))
        idx = torch.where(idx < 0, torch.full_like(idx, ctx), idx).sort(dim=1).values
        idx = torch.where(idx >= ctx, torch.full_like(idx, -1), idx)
        out[t0:t1, :k_eff] = idx.to(torch.int32)
    return out


def union_ratio(rows: torch.Tensor, group_size: int, topk_length: torch.Tensor | None = None) -> float:
    """Mean union size of full groups of ``G`` consecutive rows over the mean valid count per row.

    Invalid entries (negative) and duplicates within a row are ignored; a trailing partial
    group is left out. Returns ``nan`` when there is no full group or no valid entry.

    >>> rows = torch.tensor([[1, 2, 3, -1], [2, 3, 4, -1]], dtype=torch.int32)
    >>> union_ratio(rows, 2)
    1.3333333333333333
    """
    from shardattn.ops.union import build_union_reference

    check_tensor("rows", rows, dtypes=(torch.int32,), ndim=2)
    check_int("group_size", group_size, minimum=1)
    full = rows.shape[0] // group_size * group_size
    if full == 0:
        return float("nan")
    rows = rows[:full]
    num_rows = int(rows.max()) + 1 if rows.numel() else 0
    tl = topk_length[:full] if topk_length is not None else None
    _, lens = build_union_reference(rows, group_size=group_size, num_kv_rows=max(num_rows, 1), topk_length=tl)
    _, single = build_union_reference(rows, group_size=1, num_kv_rows=max(num_rows, 1), topk_length=tl)
    per_row = single.double().mean().item()
    return float("nan") if per_row == 0 else lens.double().mean().item() / per_row


def _torch_load(name: str) -> object:
    """The contents of a ``.pt`` file, tensors on the CPU (weights only: no code runs)."""
    return torch.load(name, map_location="cpu", weights_only=True)


def load_topk_dump(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Load a recorded top-k dump.

    Args:
        path: ``.pt`` (a dict) or ``.safetensors`` file with ``topk [T, K]`` (int32 or int64,
            request-local positions or global rows; a negative entry is invalid wherever it stands)
            and ``valid [T]`` (how many leading entries of each row to use, ``0 .. K``; optional,
            default ``K``: every entry).
    Returns:
        ``(topk [T, K] int32, valid [T] int32)`` on the CPU.
    Raises:
        ValueError: naming the file, when its contents are not a dump (a truncated or foreign file)
            or hold entries outside int32 or counts outside ``[0, K]``. OSError: a file that cannot
            be opened.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or a path, got {type(path).__name__}")
    path = Path(path)
    if path.suffix not in (".safetensors", ".pt", ".pth"):
        raise ValueError(f"path must end in .pt or .safetensors, got {path.name}")
    read: Callable[[str], object] = _torch_load
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file  # a missing package is an ImportError, not the file's fault

        read = load_file
    try:
        data = read(str(path))
    except OSError:
        raise
    except Exception as e:  # a truncated or foreign file: the readers raise their own kinds
        raise ValueError(f"{path.name} is not a readable top-k dump ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or "topk" not in data:
        raise ValueError(f"{path.name} must hold a dict with a 'topk' tensor")
    topk = data["topk"]
    check_tensor(f"{path.name}: topk", topk, dtypes=(torch.int32, torch.int64), ndim=2)
    if topk.numel() and not (int(topk.min()) >= -(2**31) and int(topk.max()) <= 2**31 - 1):
        raise ValueError(f"{path.name}: topk entries must fit int32, got [{int(topk.min())}, {int(topk.max())}]")
    topk = topk.to(torch.int32)
    k = topk.shape[1]
    valid = data.get("valid")
    if valid is None:
        return topk, torch.full((topk.shape[0],), k, dtype=torch.int32)
    check_tensor(f"{path.name}: valid", valid, dtypes=(torch.int32, torch.int64), shape=(topk.shape[0],))
    if valid.numel() and not (int(valid.min()) >= 0 and int(valid.max()) <= k):
        raise ValueError(f"{path.name}: valid counts must be in [0, {k}] (leading entries of a row), got "
                         f"[{int(valid.min())}, {int(valid.max())}]")  # fmt: skip
    return topk, valid.to(torch.int32)


def first_repeat(topk: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[int, int] | None:
    """The first ``(token, position)`` that a row of ``topk`` lists twice, or ``None`` when no row
    repeats one (what a caller promises with ``topk_unique=True``).

    Args:
        topk: ``[T, K]`` integer positions; a negative entry is invalid and never a repeat.
        valid: ``[T]`` leading entries of each row to read (``0 .. K``), optional (default ``K``).
    """
    check_tensor("topk", topk, dtypes=(torch.int32, torch.int64), ndim=2)
    pos = topk.to(torch.int64)
    if valid is not None:
        check_tensor("valid", valid, dtypes=(torch.int32, torch.int64), shape=(topk.shape[0],))
        pos = pos.masked_fill(torch.arange(pos.shape[1]) >= valid.to(torch.int64)[:, None], -1)
    ordered = pos.sort(dim=1).values
    again = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    tokens = again.any(dim=1).nonzero()
    if tokens.numel() == 0:
        return None
    t = int(tokens[0])
    return t, int(ordered[t, 1:][again[t]][0])
