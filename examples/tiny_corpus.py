"""A seeded synthetic "language" and its batches for examples/train_tiny_lm.py.

Nothing is downloaded and nothing large is stored: the language is a first-order Markov
chain over `vocab` token ids built from a seed, so the same seed gives the same corpus on
every machine. Ids 0, 1 and 2 are PAD, BOS and EOS; the other ids are "words". Each word
has a few successors drawn from a Zipf-like popularity over all words, with geometrically
decaying probabilities, so there is plenty for a small model to learn quickly: first the
skewed unigram distribution (the loss falls from ln(vocab) within a few steps), then the
bigram table. Every sequence starts with BOS, walks the chain and ends with EOS.

A step is a list of micro-batches with different numbers of sequences and different
lengths (up to the context, padded with PAD on the right). `Batch.targets` holds PAD where
there is no token to predict, so `cross_entropy(..., ignore_index=PAD)` skips it, and
`Batch.tokens` is the number of targets that count; a step's tokens (the sum over its
micro-batches) are known before its first forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD, BOS, EOS = 0, 1, 2
FIRST_WORD = 3


@dataclass
class Batch:
    """One micro-batch: inputs and targets [rows, length] (int64), PAD-filled."""

    inputs: torch.Tensor
    targets: torch.Tensor
    tokens: int  # targets != PAD

    def rows(self, start: int, stride: int) -> "Batch":
        """Returns the rows start::stride (a data-parallel rank's share), tokens recounted."""
        inputs, targets = self.inputs[start::stride], self.targets[start::stride]
        return Batch(inputs, targets, int((targets != PAD).sum()))


class MarkovLanguage:
    """A seeded first-order Markov chain over word ids FIRST_WORD..vocab-1 (plus BOS/EOS)."""

    def __init__(self, vocab: int = 2048, successors: int = 6, zipf: float = 1.1,
                 decay: float = 0.55, seed: int = 0):
        """Builds the successor table: `successors` next words per word, probabilities ∝ decay^j."""
        if vocab <= FIRST_WORD + successors:
            raise ValueError(f"vocab must exceed {FIRST_WORD + successors}, got {vocab}")
        self.vocab = vocab
        gen = torch.Generator().manual_seed(seed)
        words = vocab - FIRST_WORD
        # Popularity: a Zipf law over a seeded permutation of the words.
        ranks = torch.randperm(words, generator=gen).double() + 1.0
        popularity = ranks.pow(-zipf)
        # Row r of `successor` lists the next words of id r (rows PAD/EOS are unused; BOS's
        # row is the distribution of first words).
        self.successor = torch.multinomial(popularity.expand(vocab, words), successors,
                                           replacement=False, generator=gen) + FIRST_WORD
        weights = decay ** torch.arange(successors, dtype=torch.float64)
        self.cdf = weights.cumsum(0) / weights.sum()  # the same decay for every word
        self._gen = torch.Generator().manual_seed(seed + 1)

    def sample(self, lengths: list[int]) -> list[torch.Tensor]:
        """Returns one sequence per length: BOS, length-2 words, EOS (int64), vectorised over rows."""
        n, longest = len(lengths), max(lengths)
        out = torch.empty(n, longest, dtype=torch.int64)
        cur = torch.full((n,), BOS, dtype=torch.int64)
        out[:, 0] = cur
        for t in range(1, longest):
            u = torch.rand(n, generator=self._gen, dtype=torch.float64)
            pick = torch.searchsorted(self.cdf, u, right=True).clamp_(max=len(self.cdf) - 1)
            cur = self.successor[cur, pick]
            out[:, t] = cur
        seqs = []
        for row, length in enumerate(lengths):
            s = out[row, :length].clone()
            s[-1] = EOS
            seqs.append(s)
        return seqs


def pack(seqs: list[torch.Tensor]) -> Batch:
    """Returns the micro-batch of `seqs`: inputs s[:-1], targets s[1:], right-padded with PAD."""
    width = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(seqs), width), PAD, dtype=torch.int64)
    targets = torch.full((len(seqs), width), PAD, dtype=torch.int64)
    for row, s in enumerate(seqs):
        inputs[row, :len(s) - 1] = s[:-1]
        targets[row, :len(s) - 1] = s[1:]
    return Batch(inputs, targets, int((targets != PAD).sum()))


def make_steps(steps: int, micro_batches: int, *, vocab: int = 2048, context: int = 64,
               rows: int = 6, seed: int = 0) -> list[list[Batch]]:
    """Returns `steps` lists of `micro_batches` Batches with uneven row counts and lengths.

    Micro-batch k of step s has rows + ((s + k) mod 3) - 1 sequences (at least 2) whose
    lengths (BOS and EOS included) are drawn uniformly from [context/4, context + 1], so
    the inputs are at most `context` long and no two micro-batches hold the same number of
    loss tokens except by chance.
    """
    lang = MarkovLanguage(vocab=vocab, seed=seed)
    gen = torch.Generator().manual_seed(seed + 2)
    out = []
    for s in range(steps):
        step = []
        for k in range(micro_batches):
            n = max(2, rows + (s + k) % 3 - 1)
            lengths = torch.randint(context // 4, context + 2, (n,), generator=gen).tolist()
            step.append(pack(lang.sample(lengths)))
        out.append(step)
    return out
