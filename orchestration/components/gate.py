"""The step gate: what decides, around each training step, whether it runs, whether its
update counts and who may checkpoint. The Trainer calls it the same way in every mode and
holds no fault-tolerance branch of its own (as torchft's OptimizerWrapper keeps quorum and
commit out of the training loop).

``StepGate`` is the fixed mesh's: every step runs once, every update commits, every DP
sync that fails ends the rank, and rank 0 checkpoints. An elastic replica's gate
(orchestration.elastic.gate.ElasticGate) takes a quorum before a step, heals a replica
that is behind, reports a DP sync that a dead peer broke, and retries a step whose update
did not commit.

The protocol, per step (orchestration.trainer.Trainer):

    gate.resumed(step, with_state)            after a checkpoint was loaded (with_state: this
                                              rank's own state was in it)
    step = gate.start(step)                   once, before the loop (first quorum / heal);
                                              None: stopped (Ctrl-C) while it waited
    step = gate.before_step(step, sync)       a quorum when one is due; a heal may move the step;
                                              None: stopped while it waited (no step runs)
    gate.sync(fn, sync)                       every DP sync call of the step
    gate.commit_grads(sync)                   allreduce mode, after the gradient sync: False =
                                              drop this update
    gate.end_step(step, sync)                 False = the step did not count: run it again
    gate.settle(sync)                         before the last (or a stopping) checkpoint
    gate.leader                               whether this rank's replica checkpoints
"""
from __future__ import annotations


class StepGate:
    """The fixed mesh: nothing to agree on, nothing to heal."""

    incarnation = 0  # how many times this rank's replica was restarted before
    leader = True  # this rank's replica writes checkpoints (rank 0's stage files among them)

    def attach(self, *, params, optimizer, sync, save, facts=None, subspace=None, stop=None) -> None:
        """The parts a gate may need to heal or save this rank (an elastic one does);
        ``facts() -> dict``: what else each step's record carries (the anchor hook's);
        ``subspace``: the rank's SubspaceRun (its basis is calibrated state); ``stop() ->
        bool``: whether Ctrl-C / SIGTERM asked the rank to stop (a gate that waits checks it)."""

    def resumed(self, step: int, with_state: bool) -> None:
        """The run resumed at ``step`` from a checkpoint that held this rank's state, or
        (an elastic replica of another split than the checkpoint's) did not."""

    def start(self, step: int) -> int | None:
        """The step the run starts at; None: a stop request came while the gate waited
        (elastic: for its first quorum), and no step runs."""
        return step

    def before_step(self, step: int, sync) -> int | None:
        """The step to run now (a heal may move it on); None: a stop request came while the
        gate waited (elastic: for a quorum), and the run stops before ``step``."""
        return step

    def sync(self, fn, sync) -> None:
        """Runs one DP sync call of the step; a failure ends the rank."""
        fn()

    def commit_grads(self, sync) -> bool:
        return True

    def end_step(self, step: int, sync) -> bool:
        return True

    def settle(self, sync) -> None:
        """Before the last or a stopping checkpoint (the fixed mesh's final save merges
        DiLoCo's syncs in flight itself)."""

    def summary(self, steps_done: int) -> dict:
        """What the gate adds to the rank's record (nothing here)."""
        return {}

    def close(self) -> None:
        pass


class FailPoint:
    """Fault injection for tests (--run.fail-rank / --run.fail-step): the rank dies like a
    crashed node (SIGKILL) before that step; only its first incarnation, so that a
    restarted replica does not die again at the same place."""

    def __init__(self, cfg, rank: int, incarnation: int = 0):
        self.armed = rank == cfg.run.fail_rank and not incarnation
        self.step = cfg.run.fail_step

    def check(self, step: int) -> None:
        if self.armed and step == self.step:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
