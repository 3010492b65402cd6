"""When a chain's goal is reached: the one completion rule that ``decide``, the carrier
(``carry``), ``submit`` (a checkpoint already complete) and the segment runner (a successor
that skips) apply. The runner is shipped into jobs with it: it imports the standard library
alone.

The goal is reached when the checkpoint says the training is done, or its epoch reached
``target_epoch``; or, where there is no target (or no epoch to compare with it), when the
command exited 0 on its own before its walltime signal: running it again would only repeat it.
"""

from __future__ import annotations

from typing import Optional, Protocol


class Progress(Protocol):
    """What the rule reads of a checkpoint (``model.Progress``, the runner's ``Found``)."""

    @property
    def epoch(self) -> Optional[int]: ...

    @property
    def done(self) -> bool: ...


def reached_target(progress: Progress, target_epoch: Optional[int]) -> bool:
    """The checkpoint's epoch reached ``target_epoch``."""
    return target_epoch is not None and progress.epoch is not None and progress.epoch >= target_epoch


def goal_reached(progress: Progress, target_epoch: Optional[int]) -> bool:
    """The checkpoint says the run is complete: the training marked itself done, or its
    epoch reached ``target_epoch``."""
    return progress.done or reached_target(progress, target_epoch)


def finished_on_its_own(
    exit_code: Optional[int], signalled: bool, epoch: Optional[int], target_epoch: Optional[int]
) -> bool:
    """The command exited 0 before its walltime signal, and there is no ``target_epoch`` (or
    no ``epoch`` to compare with it): the run is over."""
    return exit_code == 0 and not signalled and (target_epoch is None or epoch is None)
