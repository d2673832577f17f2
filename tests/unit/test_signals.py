"""SIGTERM/SIGINT during training: recorded while a background save is pending, else as before."""

from __future__ import annotations

import signal

import pytest

from shardtune.training.signals import StopOnSignal, TrainingStopped

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def python_sigint_handler():
    """Python's own SIGINT handler during the test, whatever an earlier test of this process left
    installed (in the whole suite SIGINT has been found ignored); the one found is put back after."""
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, found)


def test_a_signal_is_recorded_while_a_save_is_pending_and_acts_as_before_otherwise(python_sigint_handler):
    pending = [True]
    before = signal.getsignal(signal.SIGINT)
    with StopOnSignal(pending=lambda: pending[0]) as stop:
        # raise_signal runs the handler in this thread before it returns; os.kill may land on another
        # thread of the test process, whose handler then runs a few bytecodes later (after the check)
        signal.raise_signal(signal.SIGTERM)  # would end this process without the handler
        assert stop.requested and stop.signum == signal.SIGTERM
        pending[0] = False
        with pytest.raises(KeyboardInterrupt):  # nothing to finish: SIGINT's own handler runs
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert TrainingStopped(signal.SIGTERM).exit_code == 143 and TrainingStopped(signal.SIGINT).exit_code == 130
