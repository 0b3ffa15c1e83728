"""Ctrl-C and stop signals in-process (StopSignals) and as a user at a terminal meets them.

The in-process tests deliver real signals at chosen moments: during the acknowledgement print,
twice before Python gets to run its handler, and while a checkpoint is written."""

import os
import select
import signal
import sys
import threading
import time

import pytest
from conftest import TRAIN

from halfprec.ctrl_c import quit_once, quits_once
from halfprec.errors import Preempted
from halfprec.training import signals
from halfprec.training.distributed import World
from halfprec.training.signals import StopSignals


@pytest.fixture(autouse=True)
def sigint_taken():
    """pytest started as a background job of a script ignores SIGINT, and StopSignals leaves an
    ignored SIGINT ignored (as under nohup): here it is taken as in a terminal."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_the_first_ctrl_c_is_acknowledged_and_recorded(capsys):
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
    assert stop.received == signal.SIGINT
    assert "Ctrl-C: stopping after this step with a checkpoint; Ctrl-C again to quit now" in capsys.readouterr().err


def test_a_ctrl_c_during_the_acknowledgement_quits(monkeypatch):
    """Python runs a handler for a signal that arrives while the first handler prints, inside it.
    That Ctrl-C is the second one: it must quit, not print the acknowledgement again."""
    printed = []

    def say_and_get_another(message):
        printed.append(message)
        if len(printed) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # its handler runs before this returns

    monkeypatch.setattr(signals, "say", say_and_get_another)
    with pytest.raises(KeyboardInterrupt), StopSignals():
        os.kill(os.getpid(), signal.SIGINT)
    assert len(printed) == 1


def test_two_ctrl_c_that_python_handles_in_one_call_quit(monkeypatch):
    """During one long torch op both presses arrive before Python can run its handler, which then
    runs once. Here the main thread blocks SIGINT while another thread takes both, so the C-level
    handler runs twice and Python's handler once, when the main thread takes signals again."""
    calls = []
    monkeypatch.setattr(StopSignals, "_presses", lambda self, real=StopSignals._presses: calls.append(1) or real(self))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e6)  # the other thread keeps the GIL from one press to the next

    def press_twice():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a thread starts with its creator's mask
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # the C handler runs in this thread
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    try:
        with pytest.raises(KeyboardInterrupt), StopSignals() as stop:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                presser = threading.Thread(target=press_twice)
                presser.start()
                presser.join()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            for _ in range(1000):  # Python's handler runs at one of these bytecodes
                pass
    finally:
        sys.setswitchinterval(switch)
    assert stop.received == signal.SIGINT and len(calls) == 1  # one handler call for both presses


def test_a_second_ctrl_c_while_a_checkpoint_is_written_quits_once_it_is_complete(capsys):
    written = []
    with pytest.raises(KeyboardInterrupt), StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        with stop.holding():
            os.kill(os.getpid(), signal.SIGINT)  # in the middle of torch.save
            written.append("the rest of the file")
    assert written == ["the rest of the file"]
    assert "Ctrl-C again: quitting as soon as the checkpoint being written is complete" in capsys.readouterr().err


def test_ctrl_c_after_a_stop_signal_quits():
    with pytest.raises(KeyboardInterrupt), StopSignals():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("ending", ["stop", "quit"])
def test_once_the_stop_or_the_quit_is_under_way_ctrl_c_is_ignored_to_the_exit(tmp_path, ending):
    """Under train.py (quit_once): a Ctrl-C that lands in the ending, the loop's or the process's,
    would tear apart what reports it; in a notebook (Python's handler) it is handed back as it was."""
    for handler, after in [(quit_once, signal.SIG_IGN), (signal.default_int_handler, signal.default_int_handler)]:
        signal.signal(signal.SIGINT, handler)
        with pytest.raises(Preempted if ending == "stop" else KeyboardInterrupt), StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            try:
                if ending == "stop":
                    stop.stop(World(), 3, tmp_path / "step-00000003.pt", tmp_path)
                os.kill(os.getpid(), signal.SIGINT)  # the quit
            finally:
                os.kill(os.getpid(), signal.SIGINT)  # lands in the ending: ignored
        assert signal.getsignal(signal.SIGINT) is after


def test_ctrl_c_quits_a_command_once_then_is_ignored():
    with pytest.raises(KeyboardInterrupt), quits_once():
        os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)  # lands in the lines that report the quit, or the interpreter's exit
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    with quits_once():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # ignored at the start (nohup): stays so


def test_the_handlers_and_the_wakeup_fd_are_put_back():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    with StopSignals():
        pass
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert signal.set_wakeup_fd(wakeup) == wakeup


@pytest.mark.slow  # a real run; the handler itself is tested in-process above
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_ctrl_c_twice_at_a_terminal_with_the_progress_bar_quits(tmp_path):
    """As a user types it: the terminal turns each Ctrl-C into a SIGINT for the foreground job,
    while the progress bar redraws itself from a thread of its own."""
    with Terminal(tmp_path, "logger=none", "model.hidden=[2048,2048]", "data.batch_size=1024",
                  "trainer.max_steps=100000") as out:  # fmt: skip
        out.wait_for(lambda: (tmp_path / "metrics.jsonl").exists() and (tmp_path / "metrics.jsonl").read_text())
        out.type(b"\x03")
        out.wait_for(lambda: b"Ctrl-C again to quit now" in out.text)
        out.type(b"\x03")
        code, text = out.finish()
    assert code == 130, text[-3000:]
    assert b"interrupted: quit" in text and b"Traceback" not in text


class Terminal:
    """train.py on a pseudo-terminal of its own: what it prints, and keys typed into it."""

    def __init__(self, run_dir, *overrides: str):
        import pty

        args = [sys.executable, str(TRAIN), *overrides, f"hydra.run.dir={run_dir}"]
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the terminal is its controlling terminal
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # as own_session (helpers.py) says
            os.execvpe(args[0], args, {**os.environ, "COLUMNS": "120"})
        self.text = b""

    def read(self, timeout: float) -> bool:
        """Whatever arrives within `timeout`; False once the program closed the terminal."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child exited
            return False
        self.text += data
        return bool(data)

    def wait_for(self, condition) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            assert time.monotonic() < deadline and self.read(0.01), self.text[-3000:]

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def finish(self) -> tuple[int, bytes]:
        deadline = time.monotonic() + 60
        while self.read(0.1):
            assert time.monotonic() < deadline, self.text[-3000:]
        _, status = os.waitpid(self.pid, 0)
        self.pid = 0
        return os.waitstatus_to_exitcode(status), self.text

    def __enter__(self) -> "Terminal":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pid:  # the test failed on the way: the run must not train on
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)
