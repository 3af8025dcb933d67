"""The curriculum's sampler (`sft.training.controllers.curriculum`): rows drawn with difficulty-tempered
probabilities, chunk by chunk, each chunk seeded and tempered so that a resumed run draws the same rows."""

from __future__ import annotations

import math

import torch
from torch.utils.data import Sampler


class CurriculumSampler(Sampler[int]):
    """Draws `len(scores)` row indices per epoch with the curriculum's difficulty-tempered probabilities."""

    def __init__(self, scores: list[float], curriculum, seed: int):
        self.curriculum, self.seed = curriculum, seed
        s = torch.tensor(scores, dtype=torch.float64)
        std = s.std() if len(s) > 1 else torch.tensor(0.0, dtype=torch.float64)
        self.z = (s - s.mean()) / std if std > 0 else torch.zeros_like(s)

    def __len__(self) -> int:
        return len(self.z)

    def probabilities(self, temperature: float) -> torch.Tensor:
        return torch.softmax(self.z / temperature, dim=0)

    def __iter__(self):
        epoch, n, size = self.curriculum.epoch, len(self.z), self.curriculum.chunk_size
        for chunk in range(math.ceil(n / size)):
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 10_007 + chunk)
            p = self.probabilities(self.curriculum.temperature_for(epoch, chunk))
            yield from torch.multinomial(p, min(size, n - chunk * size), replacement=True,
                                         generator=generator).tolist()
