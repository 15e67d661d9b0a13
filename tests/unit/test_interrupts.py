"""A signal stops a CLI run at the next stage boundary even when its exception was swallowed mid-stage (raised inside
a finaliser or a catch-all callback), so an interrupted run never goes on to publish and look complete."""

from __future__ import annotations

import os
import signal

import pytest

from prefect.exceptions import TerminationSignal
from prefect.utilities.engine import capture_sigterm

from flows.interrupts import Interrupted, interruptible, raise_if_interrupted


def test_a_swallowed_signal_stops_the_run_at_the_next_boundary():
    reached = []
    with pytest.raises(Interrupted) as raised:
        with interruptible():
            try:
                os.kill(os.getpid(), signal.SIGHUP)
                signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a bytecode boundary: the handler runs and raises here
            except Interrupted:
                reached.append("swallowed")  # as a finaliser or a catch-all callback would
            raise_if_interrupted()
            reached.append("next stage")
    assert reached == ["swallowed"] and raised.value.exit_code == 128 + signal.SIGHUP


def test_a_sigterm_swallowed_inside_prefects_bridge_stops_the_run_at_the_next_boundary():
    """During a flow run Prefect's SIGTERM bridge, not ours, takes SIGTERM: its TerminationSignal swallowed mid-stage
    must still stop the run before the next stage (a CI run once published status complete, then exited 143)."""
    reached = []
    with pytest.raises(Interrupted) as raised:
        with interruptible():
            with capture_sigterm():  # as the flow engine installs it around a flow run
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    signal.pthread_sigmask(signal.SIG_BLOCK, [])
                except TerminationSignal:
                    reached.append("swallowed")
                raise_if_interrupted()
                reached.append("next stage")
    assert reached == ["swallowed"] and raised.value.exit_code == 128 + signal.SIGTERM


def test_no_signal_no_stop():
    with interruptible():
        raise_if_interrupted()
    raise_if_interrupted()  # outside a block (a worker's flow run): nothing to check
