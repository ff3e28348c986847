"""Expert parallelism's two engines as one: the dense parameters' reduced and sharded
over dp x cp, the experts' over the expert-data-parallel group (the ranks holding the
same experts), with one optimizer step, one norm and one checkpoint view."""

from __future__ import annotations

import contextlib

import torch

from meshwise.comm import ops


class DenseAndExperts:
    """The engine protocol (``meshwise.sharding.engine``) over ``dense`` and ``experts``
    engines of the same ZeRO stage; ``ep_group``: the ranks holding the other experts;
    ``expert_names``: the parameters ``experts`` holds."""

    def __init__(self, dense, experts, ep_group, expert_names):
        self.dense, self.experts, self.ep_group = dense, experts, ep_group
        self.stage, self.group = dense.stage, dense.group
        self._expert_names = set(expert_names)

    @property
    def engines(self):
        return (self.dense, self.experts)

    @property
    def step_count(self) -> int:
        return self.dense.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        for engine in self.engines:
            engine.step_count = value

    @property
    def peak_gathered_bytes(self) -> int:
        return getattr(self.dense, "peak_gathered_bytes", 0)

    def zero_grad(self) -> None:
        for engine in self.engines:
            engine.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        with self.dense.no_sync(), self.experts.no_sync():
            yield

    def replicate_over(self, group, reducer=None) -> None:
        """Hybrid sharding of the dense engine (``EngineBase.replicate_over``); the
        experts' engine replicates over its own group, set where it was built."""
        self.dense.replicate_over(group, reducer)

    def finish_grad_sync(self) -> None:
        for engine in self.engines:
            engine.finish_grad_sync()

    @torch.no_grad()
    def grad_sq_norm(self, include=None, over_dp: bool = True) -> torch.Tensor:
        """As ``EngineBase.grad_sq_norm``. With ``over_dp=False`` the caller sums over
        every rank and, at stages 0-1, divides by dp x cp: each expert shard is held by
        dp x cp / ep of them there, so its part is weighted by ep."""
        dense = self.dense.grad_sq_norm(include, over_dp)
        experts = self.experts.grad_sq_norm(include, over_dp).to(dense.dtype)
        if over_dp:
            experts = experts.reshape(1)
            ops.all_reduce(experts, self.ep_group, category="norm")
            return dense + experts[0]
        if self.stage < 2:
            experts = experts * self.ep_group.size
        return dense + experts

    def held_grads(self, names: set[str]) -> list[torch.Tensor]:
        return self.dense.held_grads(names) + self.experts.held_grads(names)

    def step(self, lr: float, grad_scale=1.0, skip=None) -> None:
        for engine in self.engines:
            engine.step(lr, grad_scale, skip)

    def unstep(self) -> None:
        for engine in self.engines:
            engine.unstep()

    def wait_params(self) -> None:
        for engine in self.engines:
            engine.wait_params()

    def checkpoint_runs(self):
        return self.dense.checkpoint_runs() + self.experts.checkpoint_runs()

    def load_done(self) -> None:
        for engine in self.engines:
            engine.load_done()

    def state_bytes(self) -> int:
        return sum(engine.state_bytes() for engine in self.engines)

    def grad_of(self, name: str) -> torch.Tensor:
        engine = self.experts if name in self._expert_names else self.dense
        return engine.grad_of(name)

    def tie_grad(self, name: str) -> torch.Tensor:
        return self.dense.tie_grad(name)
