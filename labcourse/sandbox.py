"""Run untrusted code — a student's exercise cells — in a child process that cannot reach the caller.

The child defines the functions; the caller (the grader) keeps the checks and calls the child's functions through
proxies: arguments go to the child by pickle (a callable among them, such as a check's simulated clock, stays in the
caller and is called back), and what comes back is read with `torch.load(weights_only=True)`, which builds plain
data — numbers, strings, lists, tuples, dicts, tensors — and nothing that runs code. So nothing the student's code
does, redefining a check included, changes the process that decides pass or fail. A call past its time limit, or a
child that dies, ends the child; `Sandbox` then refuses further calls and a new one starts from scratch.

The child has no network: it runs under `unshare --net` where the kernel allows it (a network namespace with no
interface), and in any case with Python's sockets refusing to connect. Its working directory is a fresh temporary
folder, its output goes nowhere, and its environment holds no proxies or tokens.
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

MAX_MESSAGE = 64 * 2**20  # bytes: a function's result larger than this is refused
HEADER = struct.Struct("<Q")
CALLABLES = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    functools.partial,
)
KEEP_ENV = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "LABKIT_CACHE", "OMP_NUM_THREADS")
SEEDED = "torch, numpy as np, math"  # what an exercise cell may use without importing it (the labs' own imports)


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
    """The command prefix that starts a process without a network (`unshare -rn`), or [] where the kernel refuses."""
    try:
        done = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ["unshare", "-rn"] if done.returncode == 0 else []


class Sandbox:
    """One child process for one submission: `define` its cells, then call them through `function`."""

    def __init__(self, timeout: float = 60.0) -> None:
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.isolation = network_isolation()
        self._folder = tempfile.TemporaryDirectory(prefix="labcourse-sandbox-")
        to_child, self._write = os.pipe()
        self._read, from_child = os.pipe()
        env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ} | {"HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), env.get("PYTHONPATH")]))
        self._log = open(Path(self._folder.name, "child.log"), "w+b")  # noqa: SIM115 (closed in close())
        self._process = subprocess.Popen(
            [*self.isolation, sys.executable, "-m", "labcourse.sandbox", str(to_child), str(from_child)],
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
        self._callbacks: dict[int, Callable] = {}
        self.alive = True
        self._receive(time.monotonic() + max(self.timeout, 120.0))  # the child's "ready", once torch is imported

    def define(self, source: str) -> None:
        """Run one cell's source in a fresh namespace of the child (seeded with torch, np, math)."""
        if not isinstance(source, str):
            raise TypeError(f"source must be a str (a cell's code), got {type(source).__name__}")
        self._send(("define", source))
        self._answer(time.monotonic() + self.timeout)

    def function(self, name: str) -> Callable[..., Any]:
        """A proxy that calls the child's function `name` (defined by an earlier `define`) on the given arguments."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"name must be a Python identifier, got {name!r}")

        def call(*args: Any) -> Any:
            self._send(("call", name, args))
            return self._answer(time.monotonic() + self.timeout, args)

        call.__name__ = name
        return call

    def close(self) -> None:
        """End the child (and anything it started) and remove its folder."""
        if self._process.poll() is None:
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self._process.kill()
        self._process.wait()
        self.alive = False
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()
        self._folder.cleanup()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------- the caller's side of the pipe

    def _send(self, message: tuple) -> None:
        if not self.alive:
            raise SandboxError("the child is gone (an earlier call timed out or crashed): start a new Sandbox")
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer)
        pickler.persistent_id = self._handle  # type: ignore[method-assign]
        pickler.dump(message)
        try:
            _write_frame(self._write, buffer.getvalue())
        except BrokenPipeError:
            self._died("before it could read the call")

    def _handle(self, obj: Any) -> int | None:
        """A callable among the arguments that pickle cannot name (a lambda, a local function, a bound method, a
        partial) stays here: the child gets a number it calls back with. Module-level functions, such as those
        that rebuild a tensor, go by name as pickle sends them."""
        local = isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)) and "<" in obj.__qualname__
        if local or isinstance(obj, (types.MethodType, functools.partial)):
            self._callbacks[id(obj)] = obj
            return id(obj)
        return None

    def _answer(self, deadline: float, args: tuple = ()) -> Any:
        """Serve the child's callbacks until its answer comes; raise what the student's code raised. A tensor
        argument the function changed in place is changed here the same way, as if the call had been local."""
        import torch  # the grader's process has it already: every check imports labkit

        while True:
            kind, *rest = self._receive(deadline)
            if kind == "callback":
                handle, args = rest
                try:
                    reply = ("value", self._callbacks[handle](*args))
                except Exception as err:  # noqa: BLE001 (the check's callable failed: the child's call fails)
                    reply = ("raised", f"{type(err).__name__}: {err}")
                self._send(reply)
            elif kind == "value":
                value, after = rest
                for mine, theirs in zip(args, after):
                    if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
                        if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
                            raise StudentError(f"an argument of shape {tuple(mine.shape)} came back reshaped")
                        with torch.no_grad():
                            mine.copy_(theirs)
                return value
            elif kind == "raised":
                name, text = rest
                if name == "NotImplementedError":
                    raise NotImplementedError(text)
                raise StudentError(text)
            else:
                raise SandboxError(f"the child sent a message of unknown kind {kind!r}")

    def _receive(self, deadline: float) -> tuple:
        try:
            data = _read_frame(self._read, deadline)
        except TimeoutError:
            self.close()
            raise TimedOut(f"no answer within {self.timeout:g} s: the child was stopped") from None
        except EOFError:
            self._died("during the call")
        except OverflowError as err:
            self.close()
            raise SandboxError(str(err)) from None
        import torch  # the grader's process has it already: every check imports labkit

        try:
            message = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as err:  # noqa: BLE001 (anything but plain data is refused, whatever the error)
            self.close()
            raise SandboxError(f"the answer is not plain data (numbers, lists, dicts, tensors): {err}") from None
        if not (isinstance(message, tuple) and message and isinstance(message[0], str)):
            self.close()
            raise SandboxError(f"the child sent {type(message).__name__}, not a message")
        return message

    def _died(self, when: str) -> None:
        try:
            code = self._process.wait(timeout=5)  # the pipe closed: the process is ending, or made it end
        except subprocess.TimeoutExpired:
            code = "still running, stopped"
        self._log.seek(0)
        tail = self._log.read()[-2000:].decode(errors="replace").strip().splitlines()[-3:]
        self.close()
        said = f"; its last words: {' | '.join(tail)}" if tail else ""
        raise Crashed(f"the child process ended {when} (exit status {code}){said}")


def _write_frame(fd: int, data: bytes) -> None:
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


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
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 2**20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ----------------------------------------------------------------------------- the child


def _no_network(*args: Any, **kwargs: Any) -> None:
    raise PermissionError("no network while grading")


def _child(read_fd: int, write_fd: int) -> None:
    """Define cells and run calls as the parent asks, until the pipe closes."""
    import math
    import socket

    import numpy as np
    import torch

    for name in ("connect", "connect_ex", "sendto", "bind"):
        setattr(socket.socket, name, _no_network)
    socket.create_connection = _no_network  # type: ignore[assignment]
    socket.getaddrinfo = _no_network  # type: ignore[assignment]
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

    def raised(err: BaseException) -> tuple:
        last = traceback.format_exception(err)[-1].strip()
        return ("raised", type(err).__name__, last)

    send(("ready",))
    while True:
        try:
            kind, *rest = receive()
        except EOFError:
            return
        try:
            if kind == "define":
                namespace = {"__name__": "__exercise__", "torch": torch, "np": np, "math": math}
                exec(compile(rest[0], "<exercise cell>", "exec"), namespace)  # noqa: S102 (the point of the child)
                defined.update({k: v for k, v in namespace.items() if callable(v)})
                reply: tuple = ("value", None, [])
            else:
                name, args = rest
                if name not in defined:
                    raise NameError(f"the cell defines no function {name!r}")
                result = defined[name](*args)
                reply = ("value", result, [a if isinstance(a, torch.Tensor) else None for a in args])
        except BaseException as err:  # noqa: BLE001 (the student's code may raise anything, SystemExit included)
            reply = raised(err)
        try:
            send(reply)
        except Exception as err:  # noqa: BLE001 (a result torch.save cannot write: say so instead)
            send(("raised", "TypeError", f"TypeError: the function returned what cannot be sent back: {err}"))


def _plain(value: Any) -> Any:
    """Numpy values as Python numbers and tensors, so that `weights_only` loading accepts them."""
    import numpy as np
    import torch

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value) if type(value) in (list, tuple) else value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]))
