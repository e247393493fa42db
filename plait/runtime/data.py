"""The user's data: `--data file.py:factory`, drawn by global sample index independently of the plan.

`factory()` returns a map-style `torch.utils.data.Dataset` whose item is ONE sample in the shape
the model's `sample_batch` gives for a batch of one, without the batch dimension:
`(inputs_tuple, target)`; or `(dataset, collate_fn)` when samples need their own batching.

The run consumes one stream of samples: position i of the stream is dataset index
`order(i // N)[i % N]`, where N = len(dataset) and `order(e)` is a permutation of epoch e drawn from
the data seed (`torch.randperm` with a generator seeded by `data_seed + e`, as
`DistributedSampler` seeds its epochs). Step s of a run with global batch B takes positions
[s*B, (s+1)*B) (after a resume: from the checkpoint's `samples_seen` on), and the runtime cuts
them into data-parallel shares and micro-batches by position (`partition.replica_micro_batches`),
so every plan sees the same samples per step as one process does. A `DataLoader` with worker
processes fetches each rank's micro-batches ahead of the step.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data import default_collate as _default_collate

from plait.errors import PlaitError


class DataSpecError(PlaitError, ValueError):
    """A `--data` argument or dataset that cannot be used; the message names it and why."""


def _import_factory(spec: str) -> Callable[[], Any]:
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise DataSpecError(f"--data {spec!r}: expected file.py:factory")
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise DataSpecError(f"--data {spec!r}: file {path_text} does not exist")
    module_name = f"plait_user_data_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path.resolve())
    assert loader_spec is not None and loader_spec.loader is not None
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # DataLoader workers and pickling look modules up here
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise DataSpecError(f"{path}: importing failed: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise DataSpecError(f"{path}: no callable {name!r}")
    return factory


def default_collate(items: list[Any]) -> tuple[tuple[Any, ...], Any]:
    """Samples `(inputs_tuple, target)` -> one batch `(inputs_tuple, target)` stacked along dim 0."""
    inputs, target = _default_collate(items)
    return tuple(inputs), target


def load_data(spec: str) -> tuple[Dataset, Callable[[list[Any]], Any]]:
    """(dataset, collate) from `file.py:factory`; checks the dataset is map-style and non-empty."""
    factory = _import_factory(spec)
    try:
        made = factory()
    except PlaitError:
        raise
    except Exception as exc:
        raise DataSpecError(f"--data {spec}: the factory failed: {type(exc).__name__}: {exc}") from exc
    collate: Callable[[list[Any]], Any] = default_collate
    if isinstance(made, tuple) and len(made) == 2 and callable(made[1]):
        made, collate = made
    if not (hasattr(made, "__getitem__") and hasattr(made, "__len__")):
        raise DataSpecError(f"--data {spec}: the factory must return a map-style Dataset (with __getitem__ and "
                            f"__len__) or (dataset, collate_fn), got {type(made).__name__}")
    if len(made) < 1:
        raise DataSpecError(f"--data {spec}: the dataset is empty")
    return made, collate


class SampleOrder:
    """Stream position -> dataset index: a fresh seeded permutation per epoch (plan-independent)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = seed
        self._epochs: dict[int, torch.Tensor] = {}

    def __call__(self, position: int) -> int:
        epoch, i = divmod(position, self.size)
        if epoch not in self._epochs:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._epochs = {epoch: torch.randperm(self.size, generator=gen)}  # one epoch held at a time
        return int(self._epochs[epoch][i])


class _Batches(Sampler[list[int]]):
    """Dataset indices of a list of (first position, size) micro-batches, in order."""

    def __init__(self, order: SampleOrder, ranges: list[tuple[int, int]]) -> None:
        self.order = order
        self.ranges = ranges

    def __iter__(self) -> Iterator[list[int]]:
        for first, size in self.ranges:
            yield [self.order(first + k) for k in range(size)]

    def __len__(self) -> int:
        return len(self.ranges)


def batches(dataset: Dataset, collate: Callable[[list[Any]], Any], order: SampleOrder,
            ranges: list[tuple[int, int]], workers: int = 0) -> Iterator[Any]:
    """The collated micro-batches of `ranges` (stream positions), fetched by `workers` DataLoader
    processes ahead of use (0: in this process)."""
    loader = DataLoader(dataset, batch_sampler=_Batches(order, ranges), collate_fn=collate, num_workers=workers,
                        prefetch_factor=2 if workers else None, persistent_workers=False)
    return iter(loader)


def samples(dataset: Dataset, collate: Callable[[list[Any]], Any], order: SampleOrder, first: int,
            count: int) -> Any:
    """Stream positions first .. first+count-1 as one batch (the single-process reference)."""
    return collate([dataset[order(first + k)] for k in range(count)])
