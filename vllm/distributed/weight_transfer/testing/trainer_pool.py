# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`TrainerPool`: `TrainerRank` actors kept between tests.

pool = TrainerPool()                     # in a Ray session's driver
with pool.lend(model_dir, world=2) as ranks:
    ray.get([t.init.remote(llm, num_consumers=1, hold="half") for t in ranks])
    ...
pool.close()                             # before ray.shutdown()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import TrainerRank


class TrainerPool:
    """`TrainerRank` actors lent to one test at a time and kept between tests.

    Starting a rank costs a Ray worker process and vLLM's imports (about 9 s
    on a 2-core machine), against well under a second for the syncs most
    tests run; a pool starts each ``(model_dir, world)`` set of ranks once.
    ``lend`` yields a set reset to the checkpoint's weights with no trainer
    engine; afterwards the set is reset again and kept, or killed when the
    reset fails or outlasts ``reset_timeout_s`` (a rank still busy with a
    call the test left running). Use from the driver of a Ray session;
    ``close`` kills every kept rank.
    """

    def __init__(self, reset_timeout_s: float = 60.0) -> None:
        self.reset_timeout_s = reset_timeout_s
        self._idle: dict[tuple[str, int], list[list[Any]]] = {}

    @contextmanager
    def lend(self, model_dir: str, world: int = 1) -> Iterator[list[Any]]:
        """``world`` ranks of one trainer (a gloo group when ``world > 1``)
        holding ``model_dir``'s weights."""
        idle = self._idle.setdefault((model_dir, world), [])
        ranks = idle.pop() if idle else self._start(model_dir, world)
        try:
            yield ranks
        finally:
            if self._reset(ranks):
                idle.append(ranks)

    def _start(self, model_dir: str, world: int) -> list[Any]:
        import ray

        from vllm.distributed.weight_transfer.testing.server import free_port

        port = free_port()
        cls = ray.remote(num_cpus=0)(TrainerRank)
        return [cls.remote(model_dir, r, world, port) for r in range(world)]

    def _reset(self, ranks: list[Any]) -> bool:
        import ray

        try:
            ray.get([t.reset.remote() for t in ranks], timeout=self.reset_timeout_s)
            return True
        except Exception:
            _kill(ranks)
            return False

    def close(self) -> None:
        for sets in self._idle.values():
            for ranks in sets:
                _kill(ranks)
        self._idle.clear()


def _kill(actors: list[Any]) -> None:
    import ray

    for actor in actors:
        ray.kill(actor)
