"""Independent fp64 oracles for the tests: plain loops written from the contracts, sharing no code
with the library (no helper, no masking function, no conversion in common).

* :func:`sparse_mla_oracle`: ``out[t, h] = softmax(scale * q[t, h] . kv[rows]^T) @ kv[rows, :v_dim]``
  over the valid rows of token ``t`` (``0 <= row < R``, within ``topk_length[t]``, a row listed
  twice counted once); sinks add ``exp(sink[h])`` to the denominator only; a row with no valid key
  is ``(0, -inf)`` (``(0, sink)`` with sinks). LSE: natural log.
* :func:`topk_rows_oracle`: request-local top-k positions -> global KV rows through a paged block
  table, optionally keeping only one DCP rank's positions (converted through its local table).
* :func:`gqa_oracle`: paged GQA decode with drafts (causal or not), windows and sinks.
* :func:`gqa_prefill_oracle`: GQA prefill of new tokens over a paged cached prefix and themselves
  (causal, windows, sinks).

Every function loops over tokens and heads in Python; keep shapes tiny.
"""

from __future__ import annotations

import math

import torch

INT32_MAX = 2**31 - 1


def _keys_of(row: list[int], num_rows: int, length: int | None) -> list[int]:
    """The distinct valid rows of one token, in first-listed order."""
    keys: list[int] = []
    for k, r in enumerate(row):
        if length is not None and k >= length:
            break
        if 0 <= r < num_rows and r not in keys:
            keys.append(r)
    return keys


def _softmax(logits: list[float], sink: float | None) -> tuple[list[float], float]:
    """``(p_i, lse)`` of one (token, head): ``p_i = exp(logit_i - lse)``, the sink in the denominator only."""
    terms = logits + ([sink] if sink is not None else [])
    if not terms:
        return [], -math.inf
    m = max(terms)
    lse = m + math.log(sum(math.exp(x - m) for x in terms))
    return [math.exp(x - lse) for x in logits], lse


def sparse_mla_oracle(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    v_dim: int,
    topk_length: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA in fp64 loops (module docstring).

    Args:
        q: ``[T, H, D]`` (or ``(q_latent, q_rope)``); kv: ``[R, D]``; rows: ``[T, K]`` global rows.
        topk_length: ``[T]`` or None; sinks: ``[H]`` or None.
    Returns:
        ``(out [T, H, v_dim] fp64, lse [T, H] fp64)``.
    """
    if isinstance(q, tuple | list):
        q = torch.cat([q[0], q[1]], dim=-1)
    q64, kv64 = q.detach().cpu().double(), kv.detach().cpu().double()
    t_count, heads, _ = q64.shape
    num_rows = kv64.shape[0]
    lengths = None if topk_length is None else [int(x) for x in topk_length.tolist()]
    sink = None if sinks is None else [float(x) for x in sinks.tolist()]
    out = torch.zeros(t_count, heads, v_dim, dtype=torch.float64)
    lse = torch.full((t_count, heads), -math.inf, dtype=torch.float64)
    for t, row in enumerate(rows.tolist()):
        keys = _keys_of(row, num_rows, None if lengths is None else lengths[t])
        if not keys and sink is None:
            continue  # (0, -inf)
        k_rows = kv64[keys]  # [n, D]
        dots = (q64[t] @ k_rows.T).tolist()  # [H][n]: q[t, h] . kv[row]
        weights = []
        for h in range(heads):
            p, lse[t, h] = _softmax([scale * x for x in dots[h]], None if sink is None else sink[h])
            weights.append(p)
        if keys:
            out[t] = torch.tensor(weights, dtype=torch.float64) @ k_rows[:, :v_dim]
    return out, lse


def topk_rows_oracle(
    topk_pos: torch.Tensor,
    req_ids: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    block_stride: int | None = None,
    seq_lens: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    dcp: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """``[T, K]`` int32 global rows (``-1`` invalid) from request-local positions, in loops.

    ``row = block_table[req, p // block_size] * block_stride + p % block_size``; invalid when
    ``p < 0``, past ``topk_length``, ``p >= seq_lens[req]``, a request id outside the table, a
    block past the table's width, a negative table entry, or a row past int32. With
    ``dcp = (world, interleave, rank)`` only the positions the rank owns (``(p // I) % N == rank``)
    are kept, at local position ``(p // (N * I)) * I + p % I``.
    """
    stride = block_size if block_stride is None else block_stride
    table = block_table.tolist()
    lens = None if seq_lens is None else seq_lens.tolist()
    lengths = None if topk_length is None else topk_length.tolist()
    reqs = req_ids.tolist()
    out = []
    for t, positions in enumerate(topk_pos.tolist()):
        req = reqs[t]
        row_out = []
        for k, p in enumerate(positions):
            row = -1
            ok = p >= 0 and 0 <= req < len(table)
            ok = ok and (lengths is None or k < lengths[t]) and (lens is None or p < lens[req])
            local = p
            if ok and dcp is not None:
                world, inter, rank = dcp
                ok = (p // inter) % world == rank
                local = (p // (world * inter)) * inter + p % inter
            if ok and local // block_size < len(table[req]):
                entry = table[req][local // block_size]
                if entry >= 0 and entry * stride + local % block_size <= INT32_MAX:
                    row = entry * stride + local % block_size
            row_out.append(row)
        out.append(row_out)
    return torch.tensor(out, dtype=torch.int32).reshape(topk_pos.shape)


def gqa_oracle(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: list[int],
    *,
    scale: float,
    causal: bool = True,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged GQA decode in fp64 loops over requests, queries, heads and keys.

    Request ``b`` owns query rows ``cu_q_lens[b]:cu_q_lens[b + 1]``; its query ``j`` sits at
    position ``p = L_b - Q_b + j`` and sees keys ``lo <= k < hi`` (``hi = p + 1`` causal, else
    ``L_b``; ``lo = max(0, p - window_left)`` with a window). Key ``k`` lives at
    ``cache[block_table[b, k // page], k % page]``; query head ``h`` reads KV head
    ``h // (Hq // Hkv)``. A request with ``L_b == 0`` and rows past ``cu_q_lens[-1]`` are
    ``(0, -inf)`` even with sinks.

    Returns:
        ``(out [total_q, Hq, D] fp64, lse [total_q, Hq] fp64)``.
    """
    q64, k64, v64 = (x.detach().cpu().double() for x in (q, k_cache, v_cache))
    total, hq, d = q64.shape
    page, hkv = k64.shape[1], k64.shape[2]
    table = block_table.tolist()
    sink = None if sinks is None else [float(x) for x in sinks.tolist()]
    out = torch.zeros(total, hq, d, dtype=torch.float64)
    lse = torch.full((total, hq), -math.inf, dtype=torch.float64)
    for b, n_keys in enumerate(int(x) for x in seq_lens.tolist()):
        n_q = cu_q_lens[b + 1] - cu_q_lens[b]
        if n_keys == 0:
            continue
        for j in range(n_q):
            p = n_keys - n_q + j
            hi = p + 1 if causal else n_keys
            lo = max(0, p - window_left) if window_left >= 0 else 0
            keys = list(range(lo, hi))
            row = cu_q_lens[b] + j
            for h in range(hq):
                g = h // (hq // hkv)
                ks = [k64[table[b][t // page], t % page, g] for t in keys]
                vs = [v64[table[b][t // page], t % page, g] for t in keys]
                logits = [scale * float(q64[row, h] @ kt) for kt in ks]
                p, lse[row, h] = _softmax(logits, None if sink is None else sink[h])
                if keys:
                    out[row, h] = torch.tensor(p, dtype=torch.float64) @ torch.stack(vs)
    return out, lse


def gqa_prefill_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: list[int],
    *,
    scale: float,
    prefix_lens: list[int] | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA prefill in fp64 loops over requests, new tokens, heads and keys.

    Request ``b`` owns rows ``sum(seq_lens[:b]) + j`` (``j < seq_lens[b]``) of ``q`` / ``k`` / ``v``
    after ``P_b = prefix_lens[b]`` cached tokens; its token ``j`` sits at position ``p = P_b + j``
    and sees positions ``lo <= t <= p`` (``lo = max(0, p - window_left)`` with a window). A key at
    ``t < P_b`` is ``cache[block_table[b, t // page], t % page]``, else row ``start_b + t - P_b``
    of ``k`` / ``v``. Query head ``h`` reads KV head ``h // (Hq // Hkv)``; sinks add
    ``exp(sink[h])`` to the denominator only.

    Returns:
        ``(out [T, Hq, D] fp64, lse [T, Hq] fp64)``.
    """
    q64, k64, v64 = (x.detach().cpu().double() for x in (q, k, v))
    total, hq, d = q64.shape
    hkv = k64.shape[1]
    prefix = [0] * len(seq_lens) if prefix_lens is None else list(prefix_lens)
    kc = None if k_cache is None else k_cache.detach().cpu().double()
    vc = None if v_cache is None else v_cache.detach().cpu().double()
    table = None if block_table is None else block_table.tolist()
    page = 1 if kc is None else kc.shape[1]
    sink = None if sinks is None else [float(x) for x in sinks.tolist()]
    out = torch.zeros(total, hq, d, dtype=torch.float64)
    lse = torch.full((total, hq), -math.inf, dtype=torch.float64)
    start = 0
    for b, n in enumerate(seq_lens):
        for j in range(n):
            p = prefix[b] + j
            lo = max(0, p - window_left) if window_left >= 0 else 0
            row = start + j
            for h in range(hq):
                g = h // (hq // hkv)
                ks, vs = [], []
                for t in range(lo, p + 1):
                    if t < prefix[b]:
                        ks.append(kc[table[b][t // page], t % page, g])
                        vs.append(vc[table[b][t // page], t % page, g])
                    else:
                        ks.append(k64[start + t - prefix[b], g])
                        vs.append(v64[start + t - prefix[b], g])
                logits = [scale * float(q64[row, h] @ kt) for kt in ks]
                probs, lse[row, h] = _softmax(logits, None if sink is None else sink[h])
                if ks:
                    out[row, h] = torch.tensor(probs, dtype=torch.float64) @ torch.stack(vs)
        start += n
    return out, lse
