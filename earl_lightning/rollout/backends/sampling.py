"""Batched token sampling shared by generation backends (pure tensor math, no model), and the
check for stop strings in what a row has generated (a tokenizer's decode of its tail).

Sampling is inverse-CDF with one uniform per (row, step), drawn up front. With a seed, each
row's uniforms come from its own generator seeded by ``(seed, key, prompt length)``, so a row's
tokens depend only on its own logits and not on which other episodes share the batch: the KV
path and the re-prefill path, and two ranks of one TP group, draw identical tokens.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, key: int, position: int) -> int:
    """A 63-bit generator seed for one request; the position (prompt length) differs every turn,
    so successive turns of one episode do not reuse the same random stream."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (key & _MASK64))
    h = _splitmix64(h ^ (position & _MASK64))
    return h & ((1 << 63) - 1)


def draw_uniforms(
    seeds: list[int] | None, num_rows: int, steps: int, device: torch.device
) -> torch.Tensor:
    """[num_rows, steps] uniforms in [0, 1): per-row generators when ``seeds`` is given, else the
    global torch RNG."""
    if seeds is None:
        return torch.rand(num_rows, steps, dtype=torch.float64).to(device)
    out = torch.empty(num_rows, steps, dtype=torch.float64)
    gen = torch.Generator()
    for i, s in enumerate(seeds):
        gen.manual_seed(s)
        out[i] = torch.rand(steps, generator=gen, dtype=torch.float64)
    return out.to(device)


def filter_logits(
    logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0, vocab_limit: int | None = None
) -> torch.Tensor:
    """[B, V] -> [B, V] with excluded entries set to -inf.

    ``vocab_limit`` excludes ids the tokenizer cannot decode (models pad their vocabulary to a
    multiple of 8 or 64); such tokens would not survive the text round-trip of a chat transcript.
    """
    out = logits.clone()
    if vocab_limit is not None and vocab_limit < out.shape[-1]:
        out[:, vocab_limit:] = float("-inf")
    if 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(out.softmax(-1), dim=-1, descending=True)
        # Drop a token when the mass of the tokens ranked above it already reaches top_p; the
        # first token always survives.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_tokens(
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    vocab_limit: int | None = None,
    allowed: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    Args:
        logits: [B, V] raw next-token logits.
        uniforms: [B] uniforms in [0, 1) (ignored when greedy).
        allowed: token ids the policy may generate (None: all); every other token is masked
            before anything else, so the policy is the softmax over the allowed logits.

    Returns:
        tokens [B] int64 and their log-probs [B] float32 under softmax(logits / temperature)
        (over ``allowed`` when given), before top-k / top-p filtering (zeros when greedy).
    """
    logits = logits.float()
    if allowed is not None:
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[torch.as_tensor(allowed, dtype=torch.long, device=logits.device)] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    if greedy:
        tokens = filter_logits(logits, vocab_limit=vocab_limit).argmax(-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    probs = filter_logits(scaled, top_k=top_k, top_p=top_p, vocab_limit=vocab_limit).softmax(-1)
    cdf = probs.double().cumsum(-1)
    # right=True picks the first token whose cdf exceeds u * total, which always has mass > 0.
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    tokens = (
        torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    )
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def stop_hits(tokenizer, tokens: torch.Tensor, rows: torch.Tensor, stop: list[str]) -> torch.Tensor:
    """[B] bool: rows (among ``rows``) whose generated text now contains a stop string.

    Only the tail that can contain a string completed by the newest token is decoded; any
    earlier occurrence would already have stopped the row.
    """
    hits = torch.zeros_like(rows)
    # A token decodes to >= 1 character except for partial UTF-8 bytes; twice the longest stop
    # string plus slack covers a string that ends at the newest token.
    tail = 2 * max(len(s) for s in stop) + 8
    idx = rows.nonzero().flatten().tolist()
    if not idx:
        return hits
    texts = tokenizer.batch_decode(tokens[idx, -tail:].tolist())
    for i, text in zip(idx, texts):
        hits[i] = any(s in text for s in stop)
    return hits
