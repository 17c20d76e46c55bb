"""Prelude of the snippets that train (README.md, docs/python.md): what the prose assumes.

`model` (a small torch language model), `steps` (each step a list of micro-batches, each
with `tokens`: the loss tokens it holds) and `loss_sum(model, mb)` (the micro-batch's
summed token loss). Seeded, small and quick: three steps of two micro-batches.
"""

import torch

torch.manual_seed(0)


class MicroBatch:
    """Token ids and their next-token targets."""

    def __init__(self, ids: torch.Tensor, targets: torch.Tensor):
        self.ids, self.targets, self.tokens = ids, targets, targets.numel()


def loss_sum(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """The summed cross-entropy of the micro-batch's tokens."""
    logits = model(mb.ids)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb.targets.flatten(),
                                             reduction="sum")


model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
steps = [[MicroBatch(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
          for _ in range(2)] for _ in range(3)]
