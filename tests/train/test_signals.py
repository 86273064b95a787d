"""Preemption signals become a flag; the previous handlers come back afterwards."""

import os
import signal
import threading
import time

import pytest

from mdtrain.train.signals import PreemptionHandler


def wait_for(handler, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not handler.requested and time.monotonic() < deadline:
        time.sleep(0.01)
    return handler.requested


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_flag_instead_of_killing(sig):
    before = signal.getsignal(sig)
    with PreemptionHandler() as handler:
        assert handler.installed and not handler.requested
        os.kill(os.getpid(), sig)
        assert wait_for(handler)  # and we are still alive to check it
        assert handler.signal_name == signal.Signals(sig).name
        os.kill(os.getpid(), sig)  # a second signal is harmless too
        time.sleep(0.05)
    assert signal.getsignal(sig) == before


def test_restore_puts_back_a_custom_handler():
    seen = []

    def custom(signum, frame):
        seen.append(signum)

    old = signal.signal(signal.SIGUSR1, custom)
    try:
        handler = PreemptionHandler().install()
        assert signal.getsignal(signal.SIGUSR1) != custom
        handler.restore()
        assert signal.getsignal(signal.SIGUSR1) == custom
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGUSR1] and not handler.requested
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_install_outside_main_thread_is_a_no_op():
    result = {}

    def worker():
        handler = PreemptionHandler().install()
        result["installed"] = handler.installed
        handler.restore()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert result == {"installed": False}
