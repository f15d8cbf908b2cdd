"""The demo prompts: random token ids from a fixed seed, some repeated or sharing a prefix."""

from __future__ import annotations

import random


def _random_tokens(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    # Ids below 16 are left out: the generated tokenizers keep their special tokens there.
    return [rng.randrange(16, vocab_size) for _ in range(n)]


def demo_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """``lmcache-mooncake demo``: one prompt per length; the last one shares the first one's prefix."""
    rng = random.Random(seed)
    prompts = [_random_tokens(rng, vocab_size, n) for n in lengths]
    if len(prompts) >= 2:
        shared = prompts[0][: lengths[0] * 3 // 4]
        prompts.append(shared + _random_tokens(rng, vocab_size, 300))
    return prompts


def demo_requests(vocab_size: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """``lmcache-mooncake up --demo``: long prompts, some repeated, one sharing a prefix with another."""
    rng = random.Random(seed)
    a, b = _random_tokens(rng, vocab_size, 1500), _random_tokens(rng, vocab_size, 2600)
    shared = a[:1200] + _random_tokens(rng, vocab_size, 400)
    return [("new", a), ("new", b), ("repeat of 0", a), ("shares 1200 with 0", shared), ("repeat of 1", b)]
