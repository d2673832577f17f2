"""Stand-ins for the Checkpointer in loop tests: what the loop uses of it (``progress``, ``save``,
``wait``, ``poll``, ``save_pending``), with nothing written."""

from __future__ import annotations

from shardtune.checkpoint import TrainingProgress


class NoCheckpoints:
    """Saves nothing; ``progress`` is the registered progress the loop advances."""

    save_pending = False

    def __init__(self, progress: TrainingProgress | None = None) -> None:
        self.progress = progress if progress is not None else TrainingProgress()

    def save(self, *, step: int | None = None, epoch: int | None = None, final: bool = False) -> None:
        pass

    def wait(self) -> None:
        pass

    def poll(self, *, stop: bool = False) -> bool:
        return stop

    def set_aside(self, *, ran_on: int | None) -> str:
        return ""


class RecordingCheckpointer(NoCheckpoints):
    """Records, at every save, what a Checkpointer would read from its registered objects."""

    def __init__(self, progress: TrainingProgress, sampler) -> None:
        super().__init__(progress)
        self.sampler = sampler
        self.saves: list[tuple[int, int, int, bool]] = []
        self.sampler_states: list[dict] = []

    def save(self, *, step: int | None = None, epoch: int | None = None, final: bool = False) -> None:
        p = self.progress
        self.saves.append((p.step, p.epoch, p.batches_in_epoch, final))
        self.sampler_states.append(self.sampler.state_dict())
