"""A private RNG stream swapped in around a module's forward (a pre- and post-hook) and out after it:
the dropout of sequence-parallel layers, which hold different tokens on each tensor rank, draws
from a stream of its own per rank (Megatron forks its model-parallel RNG around such blocks), while
the replicated embedding and head keep the shared one. Both engines (`plait.runtime.worker`,
`plait.runtime.torch_worker`) use it, and checkpoints carry its state."""

from __future__ import annotations

from typing import Any

import torch


class RngStream:
    """A private RNG state swapped in around a module's forward (hooks) and out after it."""

    def __init__(self, seed: int, cuda: bool) -> None:
        self.cuda = cuda
        saved = self._get()
        torch.manual_seed(seed)
        self.state = self._get()
        self._set(saved)
        self._outer: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def _get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), torch.cuda.get_rng_state() if self.cuda else None

    def _set(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    def enter(self, *_: Any) -> None:
        self._outer = self._get()
        self._set(self.state)

    def leave(self, *_: Any) -> None:
        assert self._outer is not None
        self.state = self._get()
        self._set(self._outer)
        self._outer = None

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": self.state[0], "cuda": self.state[1]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cuda = state.get("cuda")
        self.state = (state["cpu"].cpu(), cuda.cpu() if cuda is not None and self.cuda else None)
