"""Rewards run in a process of their own: a reward that hangs, crashes or exits cannot take the trainer with it.

:class:`RewardWorker` starts one Python process per run (``python -c``, so the caller's ``__main__`` is never
re-imported there), loads the reward in it by its spec (:func:`rlalign.tasks.registry.load_reward`) and sends it
whole batches of samples; each sample is checked there as :func:`rlalign.tasks.registry.score` checks it, so the
values are the same floats bit for bit. The rules:

- **Timeout.** One reward call may take ``timeout_s`` seconds (``task.reward_timeout_s``, default 30). The worker
  writes the index and start time of the call it is in to a shared page; a call past the limit gets the worker's
  process group killed and a :class:`RewardError` naming the reward (``file.py:line:function``) and the sample.
- **Exits and crashes.** ``sys.exit`` inside a reward is a reward error (as in :func:`score`); ``os._exit``, a
  signal or a crash of the process ends it, which the trainer sees at once: a :class:`RewardError` naming the
  reward, the sample it was on and the exit status.
- **Interrupts.** The worker runs in a session of its own: Ctrl-C in the terminal reaches the trainer only, which
  stops the worker on its way out; a ``KeyboardInterrupt`` inside a reward is the reward's own, a reward error.
- **Loading.** A reward that cannot be loaded fails when the worker starts (:class:`RewardLoadError`), before
  training; importing it may take ``LOAD_TIMEOUT_S``.
- **Lifetime.** :meth:`RewardWorker.close` (or the garbage collector, or the end of the interpreter) stops the
  worker and anything it started (its own process group); a worker whose trainer died stops itself.

The reward process inherits the environment, the working directory, stdout/stderr and ``sys.path`` of the
trainer: a reward prints, reads files and imports as it did in the trainer's process.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from rlalign.tasks.registry import (RewardError, RewardLoadError, batch_columns, batch_keyword_filter, batch_label,
                                    call_batch_reward, call_reward, check_lengths, is_batched, keyword_filter,
                                    load_reward, reward_name, sample_label)

DEFAULT_TIMEOUT_S = 30.0
LOAD_TIMEOUT_S = 300.0        # importing the reward's module (a heavy import on a busy machine)
_POLL_S = 1.0                 # how often the trainer looks at the worker while it is not in a reward call
_PROGRESS = struct.Struct("<qd")   # the call the worker is in: sample index (-1: none), start (time.monotonic)
_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
         "from rlalign.tasks.reward_worker import serve; serve(int(sys.argv[2]), int(sys.argv[3]))")


class RewardWorker:
    """The reward ``spec`` (as ``task.reward`` names it) in a worker process; :meth:`score` is
    :func:`rlalign.tasks.registry.score` run there, with a per-call timeout of ``timeout_s`` seconds."""

    def __init__(self, spec: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.spec, self.timeout_s = spec, float(timeout_s)
        self._process = _Process.start()
        self._closer = weakref.finalize(self, self._process.stop)
        self.name, self.batched = spec, False
        self._stopped: "str | None" = None   # why the process ended, once it has (later calls say so)
        self._pending: "Sequence[str] | None" = None   # the prompts of the batch submitted and not yet collected
        try:
            self.name, self.batched = self._handshake()
        except BaseException:
            self.close()
            raise

    def _handshake(self) -> tuple[str, bool]:
        self._process.send(("load", self.spec))
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while not self._process.readable(min(_POLL_S, deadline - time.monotonic())):
            if self._process.exit_status() is not None:
                raise RewardLoadError(f"reward {self.spec!r}: the reward process ended while importing it "
                                      f"({self._process.how_it_ended()})")
            if time.monotonic() > deadline:
                raise RewardLoadError(f"reward {self.spec!r}: importing it did not finish within {LOAD_TIMEOUT_S:g} s")
        kind, text, *batched = self._process.receive(lambda how: RewardLoadError(
            f"reward {self.spec!r}: the reward process ended while importing it ({how})"))
        if kind == "load_error":
            raise RewardLoadError(text)
        return text, bool(batched and batched[0])

    def score(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str],
              extras: "Sequence[Mapping[str, Any]] | None" = None) -> list[float]:
        """Each sample's reward, checked (:func:`rlalign.tasks.registry.call_reward`); a :class:`RewardError` names
        the reward and the sample when a call raises, returns a bad value, passes ``timeout_s`` or ends the process.
        :meth:`submit` then :meth:`result`."""
        self.submit(prompts, completions, answers, extras)
        return self.result()

    def submit(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str],
               extras: "Sequence[Mapping[str, Any]] | None" = None) -> None:
        """Send the batch to the worker and return at once (the worker scores it while the caller does other work,
        e.g. a reward model's forward); :meth:`result` collects it. One batch at a time."""
        check_lengths(prompts, completions, answers, extras)
        if self._pending is not None:
            raise RuntimeError("RewardWorker.submit: the previous batch was not collected (call result() first)")
        if self._stopped is not None:
            raise RewardError(f"reward {self.name}: its process stopped at an earlier call ({self._stopped})")
        batch = ("score", list(prompts), list(completions), list(answers),
                 None if extras is None else [dict(e) for e in extras])
        try:
            self._process.send(batch)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise RewardError(f"reward {self.name}: the batch's samples cannot be sent to the reward process "
                              f"({type(e).__name__}: {e}); dataset fields must be plain data") from None
        except OSError:
            raise self._ended(prompts) from None
        self._pending = list(prompts)

    def result(self) -> list[float]:
        """The rewards of the batch :meth:`submit` sent (waiting for them, with the per-call timeout)."""
        prompts, self._pending = self._pending, None
        if prompts is None:
            raise RuntimeError("RewardWorker.result: no batch was submitted")
        try:
            kind, payload = self._wait_for_result(prompts)
        except RewardError as e:
            self._stopped = str(e)
            raise
        if kind == "error":
            raise RewardError(payload)
        return payload

    def _wait_for_result(self, prompts: Sequence[str]):
        while not self._process.readable(self._wait_s()):
            if self._process.exit_status() is not None:
                raise self._ended(prompts)
            index, started = self._process.progress()
            if index >= 0 and time.monotonic() - started > self.timeout_s and self._still_in(index, started):
                self._process.stop()
                raise RewardError(f"{self._label(index, prompts)} did not return within task.reward_timeout_s="
                                  f"{self.timeout_s:g} s; the reward process was stopped (fix the reward, or raise "
                                  "task.reward_timeout_s if it needs longer)")
        return self._process.receive(lambda how: self._ended(prompts))

    def _wait_s(self) -> float:
        """Until the current call's deadline (at most ``_POLL_S``: the trainer also watches for the worker's end)."""
        index, started = self._process.progress()
        if index < 0:
            return _POLL_S
        return min(_POLL_S, max(0.01, started + self.timeout_s - time.monotonic()))

    def _still_in(self, index: int, started: float) -> bool:
        """The same call a moment later: the page is written while it is read only between two calls."""
        time.sleep(0.01)
        return self._process.progress() == (index, started)

    def _ended(self, prompts: Sequence[str]) -> RewardError:
        index, _ = self._process.progress()
        how = self._process.how_it_ended()
        if 0 <= index < len(prompts):
            return RewardError(f"{self._label(index, prompts)} ended the reward process ({how}) instead of returning "
                               "a reward (os._exit, a crash or a kill); a reward must return a number")
        return RewardError(f"reward {self.name}: the reward process ended ({how}) outside a reward call")

    def _label(self, index: int, prompts: Sequence[str]) -> str:
        return batch_label(self.name, prompts) if self.batched else sample_label(self.name, index, prompts[index])

    def close(self) -> None:
        """Stop the worker (and every process it started); idempotent."""
        self._closer()

    def __enter__(self) -> "RewardWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Process:
    """The worker's process, its connection and its progress page (the trainer's side)."""

    def __init__(self, popen: subprocess.Popen, conn: Connection, page: mmap.mmap):
        self.popen, self.conn, self.page = popen, conn, page

    @classmethod
    def start(cls) -> "_Process":
        ours, theirs = socket.socketpair()
        with tempfile.TemporaryFile() as file:
            file.truncate(_PROGRESS.size)
            page = mmap.mmap(file.fileno(), _PROGRESS.size)
            _PROGRESS.pack_into(page, 0, -1, 0.0)
            fds = (theirs.fileno(), file.fileno())
            # -u: a reward's prints appear as they happen; a new session: the worker and whatever it starts
            # form one process group, stopped together
            path = json.dumps([str(p) for p in sys.path])   # the trainer's imports work there too
            popen = subprocess.Popen([sys.executable, "-u", "-c", _BOOT, path, *map(str, fds)], pass_fds=fds,
                                     start_new_session=True)
        theirs.close()
        return cls(popen, Connection(ours.detach()), page)

    def send(self, message) -> None:
        self.conn.send(message)

    def readable(self, timeout: float) -> bool:
        return bool(wait([self.conn], max(timeout, 0.0)))

    def receive(self, on_end):
        """The next message; ``on_end(how)`` is raised when the process closed the connection (it ended)."""
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.popen.wait()
            raise on_end(self.how_it_ended()) from None

    def progress(self) -> tuple[int, float]:
        return _PROGRESS.unpack_from(self.page, 0)

    def exit_status(self) -> "int | None":
        return self.popen.poll()

    def how_it_ended(self) -> str:
        code = self.popen.wait()
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    def stop(self) -> None:
        """Ask the worker to end, then kill its process group (a hung reward, processes a reward started)."""
        if self.popen.poll() is None:
            try:
                self.conn.send(("close",))
                self.popen.wait(timeout=2.0 if self.progress()[0] < 0 else 0.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait()
        self.conn.close()


# ---- the worker's side ---------------------------------------------------------------------------------------

def serve(conn_fd: int, page_fd: int) -> None:
    """The worker process: load the reward, then score batches until told to close (or the trainer is gone)."""
    _stop_with_the_trainer(os.getppid())
    conn = Connection(conn_fd)
    page = mmap.mmap(page_fd, _PROGRESS.size)
    _, spec = conn.recv()
    try:
        reward_fn = load_reward(spec)
    except RewardLoadError as e:
        conn.send(("load_error", str(e)))
        return
    except BaseException as e:   # sys.exit or KeyboardInterrupt at the module's import
        conn.send(("load_error", f"reward {spec!r}: importing it raised {type(e).__name__}: {e}"))
        return
    name, batched = reward_name(reward_fn), is_batched(reward_fn)
    accepts = batch_keyword_filter(reward_fn) if batched else keyword_filter(reward_fn)
    conn.send(("ready", name, batched))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "close":
            return
        score_batch = _score_whole_batch if batched else _score_batch
        conn.send(score_batch(reward_fn, name, accepts, page, *message[1:]))


def _score_whole_batch(reward_fn, name: str, accepts, page: mmap.mmap, prompts, completions, answers, extras):
    """A batched reward: one call (the page names it as sample 0 while it runs; the timeout covers the call)."""
    _PROGRESS.pack_into(page, 0, 0, time.monotonic())
    try:
        return "values", call_batch_reward(reward_fn, name, prompts, completions,
                                           accepts(batch_columns(answers, extras)), catch=(BaseException,))
    except RewardError as e:
        return "error", str(e)
    finally:
        _PROGRESS.pack_into(page, 0, -1, 0.0)


def _score_batch(reward_fn, name: str, accepts, page: mmap.mmap, prompts, completions, answers, extras):
    """("values", [float, ...]) or ("error", the RewardError's line), the page naming each call as it runs."""
    values = []
    try:
        for i, (prompt, completion, answer) in enumerate(zip(prompts, completions, answers)):
            _PROGRESS.pack_into(page, 0, i, time.monotonic())
            values.append(call_reward(reward_fn, sample_label(name, i, prompt), prompt, completion, answer,
                                      accepts(extras[i]) if extras is not None else {}, catch=(BaseException,)))
    except RewardError as e:
        return "error", str(e)
    finally:
        _PROGRESS.pack_into(page, 0, -1, 0.0)
    return "values", values


def _stop_with_the_trainer(trainer_pid: int) -> None:
    """A thread that kills this process group when the trainer is gone (its parent changes), even while a reward
    hangs (a pure-Python loop releases the GIL to it)."""
    def watch():
        while os.getppid() == trainer_pid:
            time.sleep(0.5)
        os.killpg(os.getpgid(0), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True, name="rlalign-reward-watchdog").start()


__all__ = ["RewardWorker", "DEFAULT_TIMEOUT_S", "LOAD_TIMEOUT_S", "serve"]
