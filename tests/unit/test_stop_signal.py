"""``wait_for_stop_signal``: the wait of ``tensorfleet dashboard`` and ``serve-model`` for Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import threading
import time

from tensorfleet.web import wait_for_stop_signal


def test_a_sigterm_that_lands_on_another_thread_still_ends_the_wait():
    """The kernel hands a process's signal to any thread; one that lands elsewhere must not be missed."""
    main, returned = threading.get_ident(), threading.Event()

    def signal_from_a_thread() -> None:
        while signal.getsignal(signal.SIGTERM) is before:  # (bounded by the suite's per-test timeout)
            time.sleep(0.01)  # until the wait's handler is in: the default action would end pytest
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # delivered to this thread, not the main one
        if not returned.wait(8):
            signal.pthread_kill(main, signal.SIGINT)  # unstick a wait that missed it: the assert below then fails

    before = signal.getsignal(signal.SIGTERM)
    helper = threading.Thread(target=signal_from_a_thread)
    started = time.monotonic()
    helper.start()
    wait_for_stop_signal()
    waited = time.monotonic() - started
    returned.set()
    helper.join()
    assert waited < 5.0, f"the wait took {waited:.1f} s: it missed the signal"
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are back
