"""Run one function in a process of its own and bring back what it returns, logs and raises.

An export's torch half (load, trace, lower, eager's references) runs this way: when the process ends, all its
memory returns to the system, including what libraries keep until then (onnxscript 0.7's rewrite rules hold the
last graph they matched, and through it the model's weights), before onnxruntime validates and quantizes. The
process is spawned, not forked: a fork of a process that has used torch's thread pool can hang, and a fork would
carry the parent's memory. The function is named as "module:function", so that the parent never imports its
module (and torch with it). Its result comes back through a file that the parent reads once the process has
ended: sent through the pipe, it would be held three times at once (pickled in the child, received, unpickled).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from importlib import import_module


class IsolatedError(Exception):
    """The process ended without an answer (killed, most often by the kernel when memory ran out)."""


def run_isolated(target: str, *args, log: Callable[[str], None] | None = None, absent: tuple[str, ...] = ()):
    """`module.function(*args)` in a spawned process; given `log`, the function takes `log=` too, and its lines go
    to `log` as they come. `absent`: packages the process takes as not installed, so that a library importing an
    optional package wherever it is installed leaves it out."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_serve, args=(sender, target, args, log is not None, absent), daemon=True)
    process.start()
    sender.close()  # the child's copy is the only writer left: its exit ends the pipe
    try:
        while True:
            try:
                kind, value, where = receiver.recv()
            except EOFError:
                process.join()
                raise IsolatedError(_died(target, process.exitcode)) from None
            if kind == "log":
                log(value)
            elif kind == "result":
                process.join()
                try:
                    with open(value, "rb") as file:
                        return pickle.load(file)
                finally:
                    os.unlink(value)
            else:
                if where:
                    value.add_note(f"raised in {target}'s process:\n{where}")
                raise value
    finally:
        receiver.close()
        process.join(timeout=60)
        if process.is_alive():
            process.kill()


def _died(target: str, code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        cause = " (the kernel's out-of-memory killer sends it when memory runs out)" if name == "SIGKILL" else ""
        return f"{target} was ended by {name}{cause}"
    return f"{target} ended with exit code {code} before it answered"


def named(target: str) -> Callable:
    """The function a "module:function" target names."""
    module, name = target.split(":")
    return getattr(import_module(module), name)


def _serve(sender, target: str, args: tuple, logs: bool, absent: tuple[str, ...]) -> None:
    for name in absent:
        sys.modules.setdefault(name, None)  # import raises ImportError, and importlib.util.find_spec finds nothing

    def log(line: str) -> None:
        sender.send(("log", line, None))

    try:
        result = named(target)(*args, **({"log": log} if logs else {}))
    except BaseException as error:  # every error goes back to be raised in the parent
        _send_error(sender, error)
    else:
        descriptor, path = tempfile.mkstemp(prefix="kvg-isolated-", suffix=".pickle")
        with os.fdopen(descriptor, "wb") as file:
            pickle.dump(result, file, protocol=pickle.HIGHEST_PROTOCOL)
        del result
        sender.send(("result", path, None))
    finally:
        sender.close()


def _send_error(sender, error: BaseException) -> None:
    """The error itself where it pickles, with its traceback as text (a note, shown only with a traceback);
    otherwise a RuntimeError that names it."""
    where = "".join(traceback.format_exception(error))
    try:
        sender.send(("error", error, where))
    except Exception:  # one that cannot be pickled
        sender.send(("error", RuntimeError(f"{type(error).__name__}: {error}"), where))
