"""Run untrusted code — a student's exercise cells — in a child process, so that the checks judging it stay apart.

The child defines the functions; the caller (the grader) keeps the checks and calls the child's functions through
proxies: arguments go to the child by pickle (a callable among them, such as a check's simulated clock, stays in the
caller and is called back), and what comes back is read with `torch.load(weights_only=True)`, which builds plain
data — numbers, strings, lists, tuples, dicts, tensors — and nothing that runs code, within a size and a node budget.
So nothing the student's code does inside Python, redefining a check included, changes the process that decides
pass or fail. A call past its time limit, or a child that dies, ends the child (and what it started); `Sandbox` then
refuses further calls and a new one starts from scratch.

The child has no network where the kernel allows an unprivileged namespace (`unshare -rn`, as here), and Python's
sockets refuse in any case; `isolated` says which. It works in a scratch folder, its output goes nowhere, it may
write no file over 64 MiB, and its environment holds no proxies or tokens. It runs as the grader's user, though:
what that user may write, the child may write. Grade untrusted work as a throwaway user (or in a container).
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_MESSAGE = 64 * 2**20  # bytes: an answer larger than this, on the pipe or as a tensor, is refused
MAX_NODES = 10**6  # containers and values in one answer, counted without sharing: a bigger one is refused
MAX_DEPTH = 100
HEADER = struct.Struct("<Q")
KEEP_ENV = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "LABKIT_CACHE", "OMP_NUM_THREADS")
STARTUP_S = 120.0  # the child's start (torch) and a lab's imports get at least this long


class SandboxError(RuntimeError):
    """The child could not give an answer: it timed out, died, or sent what the caller cannot accept."""


class TimedOut(SandboxError):
    """A definition or a call ran past the time limit; the child was killed."""


class Crashed(SandboxError):
    """The child process ended in the middle of a definition or a call."""


class StudentError(RuntimeError):
    """The student's code raised: the message carries its exception and the last line of its traceback."""


@functools.cache
def network_isolation() -> list[str]:
    """The command prefix that starts a process in namespaces of its own — no network, its own process tree that
    dies with it — or [] where the kernel refuses unprivileged namespaces."""
    for prefix in (["unshare", "-rn", "--pid", "--fork", "--kill-child"], ["unshare", "-rn"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            return []
    return []


class Sandbox:
    """One child process for one student: `prelude` a lab's imports, `define` cells, call them through `function`,
    each definition or call within `timeout` seconds and, once `limit` is set, within that budget in all."""

    def __init__(self, timeout: float = 60.0) -> None:
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        prefix = network_isolation()
        self.isolated = bool(prefix)
        self._closed, self.alive, self._budget_end = False, False, float("inf")
        self._callbacks: dict[int, Callable] = {}
        self._callback_error: BaseException | None = None
        self._folder = tempfile.TemporaryDirectory(prefix="labcourse-sandbox-", ignore_cleanup_errors=True)
        to_child, self._write = os.pipe()
        self._read, from_child = os.pipe()
        env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ} | {"HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), env.get("PYTHONPATH")]))
        self._log = open(Path(self._folder.name, "child.log"), "w+b")  # noqa: SIM115 (closed in close())
        self._process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "labcourse.sandbox", str(to_child), str(from_child)],
            pass_fds=(to_child, from_child),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            cwd=self._folder.name,
            env=env,
            start_new_session=True,
        )
        os.close(to_child)
        os.close(from_child)
        os.set_blocking(self._write, False)  # a child that stops reading must not hang the caller
        self.alive = True
        self._expect(self._receive(time.monotonic() + max(self.timeout, STARTUP_S)), "ready")

    def limit(self, seconds: float | None) -> None:
        """Give the calls from now on `seconds` in all (an exercise's budget); None lifts the budget."""
        self._budget_end = float("inf") if seconds is None else time.monotonic() + seconds

    def prelude(self, imports: list[str]) -> None:
        """Import statements every later definition sees (a lab's own imports); one that fails is skipped."""
        self._send(("prelude", list(imports)), time.monotonic() + STARTUP_S)
        self._answer(time.monotonic() + max(self.timeout, STARTUP_S))

    def define(self, source: str) -> None:
        """Run one cell's source in a fresh namespace of the child (the prelude's names, torch, np, math)."""
        if not isinstance(source, str):
            raise TypeError(f"source must be a str (a cell's code), got {type(source).__name__}")
        deadline = self._deadline()
        self._send(("define", source), deadline)
        self._answer(deadline)

    def function(self, name: str) -> Callable[..., Any]:
        """A proxy that calls the child's function `name` (defined by an earlier `define`) on the given arguments."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be a Python identifier, got {name!r}")

        def call(*args: Any) -> Any:
            deadline = self._deadline()
            self._send(("call", name, args), deadline)
            return self._answer(deadline, args)

        call.__name__ = name
        return call

    def close(self) -> None:
        """End the child and everything it started, and remove its folder; calling it again does nothing."""
        if self._closed:
            return
        self._closed, self.alive = True, False
        try:
            os.killpg(self._process.pid, signal.SIGKILL)  # the child's session: what it forked too
        except (ProcessLookupError, PermissionError):
            pass
        self._process.kill()
        self._process.wait()
        for fd in (self._read, self._write):
            os.close(fd)
        self._log.close()
        self._folder.cleanup()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------- the caller's side of the pipe

    def _deadline(self) -> float:
        return min(time.monotonic() + self.timeout, self._budget_end)

    def _send(self, message: tuple, deadline: float) -> None:
        if not self.alive:
            raise SandboxError("the child is gone (an earlier call timed out or crashed): start a new Sandbox")
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer)
        pickler.persistent_id = self._handle  # type: ignore[method-assign]
        pickler.dump(message)
        try:
            _write_frame(self._write, buffer.getvalue(), deadline)
        except TimeoutError:
            self.close()
            raise TimedOut(f"the child read nothing within {self.timeout:g} s: it was stopped") from None
        except BrokenPipeError:
            self._died("before it could read the call")

    def _handle(self, obj: Any) -> int | None:
        """A callable among the arguments that pickle cannot send by name (a lambda, a local function, a bound
        method, builtin or not, a partial) stays here: the child gets a number it calls back with."""
        local = isinstance(obj, types.FunctionType) and "<" in obj.__qualname__
        bound = isinstance(obj, types.BuiltinMethodType) and not isinstance(
            obj.__self__, (types.ModuleType, type(None))
        )
        if local or bound or isinstance(obj, (types.MethodType, functools.partial)):
            self._callbacks[id(obj)] = obj
            return id(obj)
        return None

    def _answer(self, deadline: float, args: tuple = ()) -> Any:
        """Serve the child's callbacks until its answer comes; raise what the student's code raised (or, first, what
        a callback of the caller's raised, whatever the student's code did with it). A tensor argument the function
        changed in place is changed here the same way, as if the call had been local."""
        import torch  # the caller has it already: every check imports labkit

        try:
            while True:
                message = self._receive(deadline)
                if message[0] == "callback":
                    handle, callback_args = self._expect(message, "callback")
                    try:
                        reply: tuple = ("value", self._callbacks[handle](*callback_args))
                    except Exception as err:  # noqa: BLE001 (the caller's callable failed: the child's call fails)
                        self._callback_error = self._callback_error or err
                        reply = ("raised", f"{type(err).__name__}: {err}")
                    self._send(reply, deadline)
                    continue
                if self._callback_error is not None:
                    raise self._callback_error
                if message[0] == "raised":
                    name, text = self._expect(message, "raised")
                    raise NotImplementedError(text) if name == "NotImplementedError" else StudentError(text)
                value, after = self._expect(message, "value")
                for mine, theirs in zip(args, after):
                    if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
                        if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
                            raise StudentError(
                                f"an argument of shape {tuple(mine.shape)} and dtype {mine.dtype} came back as "
                                f"{tuple(theirs.shape)}, {theirs.dtype}: change a tensor in place, keep its shape"
                            )
                        with torch.no_grad():
                            mine.copy_(theirs)
                return value
        finally:
            self._callbacks.clear()
            self._callback_error = None

    def _expect(self, message: tuple, kind: str) -> tuple:
        """The message's fields after its kind, if it has the shape that kind has; else the child is stopped."""
        shapes = {"ready": (), "callback": (int, tuple), "raised": (str, str), "value": (object, list)}
        fields = message[1:]
        if message[0] != kind or len(fields) != len(shapes[kind]) or not all(map(isinstance, fields, shapes[kind])):
            self.close()
            raise SandboxError(f"the child sent a malformed {message[0]!r} message where a {kind!r} was due")
        return fields

    def _receive(self, deadline: float) -> tuple:
        try:
            data = _read_frame(self._read, deadline)
        except TimeoutError:
            self.close()
            raise TimedOut(f"no answer within {self.timeout:g} s (or the exercise's budget): stopped") from None
        except EOFError:
            self._died("during the call")
        except OverflowError as err:
            self.close()
            raise SandboxError(str(err)) from None
        import torch  # the caller has it already: every check imports labkit

        try:
            message = torch.load(io.BytesIO(data), weights_only=True)
            _within_budget(message)
        except Exception as err:  # noqa: BLE001 (anything but plain data within budget is refused)
            self.close()
            why = str(err).strip().splitlines()[-1][:300] if str(err).strip() else type(err).__name__
            raise SandboxError(
                f"the answer is not plain data of a sane size (numbers, lists, tensors): {why}"
            ) from None
        if not (isinstance(message, tuple) and message and message[0] in ("ready", "callback", "raised", "value")):
            self.close()
            raise SandboxError(f"the child sent {type(message).__name__}, not a message")
        return message

    def _died(self, when: str) -> None:
        try:
            code: object = self._process.wait(timeout=5)  # the pipe closed: the process is ending, or made it end
        except subprocess.TimeoutExpired:
            code = "still running, stopped"
        size = os.fstat(self._log.fileno()).st_size
        self._log.seek(max(0, size - 2000))
        tail = self._log.read(2000).decode(errors="replace").strip().splitlines()[-3:]
        self.close()
        said = f"; its last words: {' | '.join(tail)}" if tail else ""
        raise Crashed(f"the child process ended {when} (exit status {code}){said}")


def _within_budget(value: Any) -> None:
    """Refuse an answer that is small on the pipe but huge to use: a tensor over MAX_MESSAGE bytes (an expanded
    view), more than MAX_NODES values counted as a check would walk them, or nesting deeper than MAX_DEPTH."""
    import torch

    count = 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_NODES or depth > MAX_DEPTH:
            raise ValueError(f"more than {MAX_NODES:,} values or deeper than {MAX_DEPTH} levels")
        if isinstance(item, torch.Tensor) and item.numel() * item.element_size() > MAX_MESSAGE:
            raise ValueError(f"a tensor of {item.numel():,} elements, over {MAX_MESSAGE:,} bytes")
        if isinstance(item, (list, tuple, set, frozenset)):
            stack += [(x, depth + 1) for x in item]
        elif isinstance(item, dict):
            stack += [(x, depth + 1) for pair in item.items() for x in pair]


def _write_frame(fd: int, data: bytes, deadline: float | None = None) -> None:
    """One length-prefixed message; on a non-blocking fd, TimeoutError when the reader takes none of it in time."""
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            _wait(fd, select.POLLOUT, deadline)


def _read_frame(fd: int, deadline: float | None) -> bytes:
    """One length-prefixed message; TimeoutError past `deadline` (monotonic), EOFError at the end of the pipe."""
    header = _read_exactly(fd, HEADER.size, deadline)
    (size,) = HEADER.unpack(header)
    if size > MAX_MESSAGE:
        raise OverflowError(f"an answer of {size:,} bytes, more than the {MAX_MESSAGE:,} allowed")
    return _read_exactly(fd, size, deadline)


def _read_exactly(fd: int, size: int, deadline: float | None) -> bytes:
    chunks, left = [], size
    while left:
        if deadline is not None:
            _wait(fd, select.POLLIN, deadline)
        chunk = os.read(fd, min(left, 2**20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _wait(fd: int, event: int, deadline: float | None) -> None:
    """Until `fd` is ready for `event` (or closed at the other end); TimeoutError past `deadline`."""
    poller = select.poll()
    poller.register(fd, event)
    wait = None if deadline is None else deadline - time.monotonic()
    if wait is not None and (wait <= 0 or not poller.poll(wait * 1000)):
        raise TimeoutError
    if wait is None:
        poller.poll()


# ----------------------------------------------------------------------------- the child


def _no_network(*args: Any, **kwargs: Any) -> None:
    raise PermissionError("no network while grading")


def _child(read_fd: int, write_fd: int) -> None:
    """Define cells and run calls as the parent asks, until the pipe closes."""
    import math
    import resource
    import socket

    import numpy as np
    import torch

    for name in ("connect", "connect_ex", "sendto", "bind"):
        setattr(socket.socket, name, _no_network)
    socket.create_connection = _no_network  # type: ignore[assignment]
    socket.getaddrinfo = _no_network  # type: ignore[assignment]
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_MESSAGE, MAX_MESSAGE))  # no file (the log included) past this
    seeded: dict[str, Any] = {"torch": torch, "np": np, "math": math}
    defined: dict[str, Any] = {}

    def send(message: tuple) -> None:
        buffer = io.BytesIO()
        torch.save(_plain(message), buffer)
        _write_frame(write_fd, buffer.getvalue())

    def receive() -> tuple:
        unpickler = pickle.Unpickler(io.BytesIO(_read_frame(read_fd, None)))
        unpickler.persistent_load = callback  # type: ignore[method-assign]
        return unpickler.load()

    def callback(handle: int) -> Callable:
        def call(*args: Any) -> Any:
            send(("callback", handle, args))
            kind, value = receive()
            if kind == "raised":
                raise RuntimeError(value)
            return value

        return call

    send(("ready",))
    while True:
        try:
            kind, *rest = receive()
        except EOFError:
            return
        try:
            if kind == "prelude":
                for statement in rest[0]:
                    try:
                        exec(statement, seeded)  # noqa: S102 (the lab's own import statements)
                    except Exception:  # noqa: BLE001, S110 (an import this child cannot make: the cell may not need it)
                        pass
                reply: tuple = ("value", None, [])
            elif kind == "define":
                namespace = {"__name__": "__exercise__", **seeded}
                exec(compile(rest[0], "<exercise cell>", "exec"), namespace)  # noqa: S102 (the point of the child)
                defined.update({k: v for k, v in namespace.items() if callable(v)})
                reply = ("value", None, [])
            else:
                name, args = rest
                if name not in defined:
                    raise NameError(f"the cell defines no function {name!r}")
                result = defined[name](*args)
                reply = ("value", result, [a if isinstance(a, torch.Tensor) else None for a in args])
        except BaseException as err:  # noqa: BLE001 (the student's code may raise anything, SystemExit included)
            reply = ("raised", type(err).__name__, traceback.format_exception(err)[-1].strip())
        try:
            send(reply)
        except Exception as err:  # noqa: BLE001 (a result torch.save cannot write: say so instead)
            send(("raised", "TypeError", f"TypeError: the function returned what cannot be sent back: {err}"))


def _plain(value: Any) -> Any:
    """What a notebook would take as it is, in forms `weights_only` reads: numpy values as Python numbers and
    tensors, a generator, map or range as a list, a namedtuple or torch's return types as a tuple."""
    import numpy as np
    import torch

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, (types.GeneratorType, map, filter, zip, range, enumerate, reversed)):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]))
