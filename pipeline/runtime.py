"""How one component calls another: through Ray, or in this process (``ray.address: inprocess``).

Every component is a plain class behind a thin actor shell, and the shells
only ever call each other as ``handle.method.remote(...)`` and wait with
``get`` / ``wait`` from this module. With Ray those are Ray's own calls. In
the in-process mode (``LocalActor``) the same plain classes run in the
driver's process, each on its own thread, with Ray's actor semantics kept:

* calls to one actor run one at a time, in the order they were made (an
  actor's concurrency groups, like the learner's ``control`` group, get a
  thread of their own); async actors (the supply board, the replay shards)
  run on their own event loop, where their calls interleave at ``await``;
* ``.remote()`` returns at once with a ``LocalRef``, a future that ``get``,
  ``wait`` and ``await`` accept; an exception raised by the method is raised
  by ``get``; ``get``'s timeout raises Ray's ``GetTimeoutError``;
* a killed actor's calls raise Ray's ``RayActorError``, as a dead actor's do.

What the mode leaves out is what needs several processes: Ray's start-up
(about 3 s of the 5 s before the first update of a small run), placement,
several learners (one process holds one torch process group), and a crashed
actor being replaced (a thread cannot be killed). It is for a laptop, a
notebook, a debugger and tests: one process, no Ray processes at all.

Why not Ray's own ``local_mode``: it still starts Ray's processes, runs each
call to completion inside ``.remote()`` (an actor that waits on another
deadlocks), and is deprecated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import os
import queue
import threading
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

__all__ = ["INPROCESS", "LocalActor", "LocalRef", "create", "get", "wait", "put", "kill"]

#: The ``ray.address`` value that selects this mode.
INPROCESS = "inprocess"


class LocalRef:
    """The result of an in-process ``.remote()`` call: a future, awaitable from an async actor's loop."""

    __slots__ = ("future",)

    def __init__(self, future: concurrent.futures.Future):
        self.future = future

    @classmethod
    def of(cls, value: Any) -> "LocalRef":
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(value)
        return cls(future)

    def __await__(self):
        return asyncio.wrap_future(self.future).__await__()


# ---------------------------------------------------------------------- waiting
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_rss_mb() -> float:
    """This process's resident memory in MiB (Linux /proc; 0 where there is none). In process, the whole run's."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES / 2**20
    except OSError:
        return 0.0


def get(refs, timeout: float | None = None):
    """``ray.get`` for Ray refs, and the same for ``LocalRef``s (one, or a list)."""
    items = refs if isinstance(refs, list) else [refs]
    if not items:
        return []  # nothing to wait for: ray.get([]) would start a whole Ray when none is up (an in-process run)
    if not any(isinstance(r, LocalRef) for r in items):
        return ray.get(refs, timeout=timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for r in items:
        if not isinstance(r, LocalRef):  # a Ray ref in an in-process run (Ray happens to be up): its own wait
            out.append(ray.get(r, timeout=None if deadline is None else max(0.0, deadline - time.monotonic())))
            continue
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            out.append(r.future.result(timeout=left))
        except concurrent.futures.TimeoutError:
            raise GetTimeoutError(f"Get timed out: an in-process call did not finish within {timeout} s") from None
        except concurrent.futures.CancelledError:  # an async actor's call, cancelled when the actor was killed
            raise RayActorError(error_msg="in-process actor killed while this call was pending") from None
    return out if isinstance(refs, list) else out[0]


def resolve(value_or_ref, timeout: float | None = None):
    """The value of a ref (``get``), or the value itself: what may come either way (policy weights come by value
    when small, as an object when large)."""
    return get(value_or_ref, timeout=timeout) if _is_ref(value_or_ref) else value_or_ref


def wait(refs: list, num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
    """``ray.wait``: (ready, not ready), each in the order of ``refs``."""
    if not any(isinstance(r, LocalRef) for r in refs):
        return ray.wait(refs, num_returns=num_returns, timeout=timeout)
    futures = [r.future if isinstance(r, LocalRef) else r.future() for r in refs]  # a Ray ref among them too
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done = [r for r, f in zip(refs, futures) if f.done()]
        left = None if deadline is None else deadline - time.monotonic()
        if len(done) >= num_returns or (left is not None and left <= 0):
            ready = done[:num_returns]
            return ready, [r for r in refs if not any(r is x for x in ready)]
        concurrent.futures.wait([f for f in futures if not f.done()], timeout=left,
                                return_when=concurrent.futures.FIRST_COMPLETED)


def put(value: Any):
    """``ray.put`` when this process is connected to Ray; else an in-process ref to ``value`` itself (no copy:
    the caller hands over a value it no longer changes, as everything put on the data path here is)."""
    if ray.is_initialized():
        return ray.put(value)
    return LocalRef.of(value)


def kill(handle) -> None:
    if isinstance(handle, LocalActor):
        handle.kill()
    else:
        ray.kill(handle)


# ---------------------------------------------------------------------- actors
def plain_class(actor_class) -> type:
    """The class a ``ray.remote`` actor class was made from (a plain class is returned as it is)."""
    return getattr(actor_class, "__ray_actor_class__", actor_class)


def create(actor_class, options: dict, *args, inprocess: bool = False, **kwargs):
    """One actor: ``actor_class.options(**options).remote(...)`` with Ray; in process, a ``LocalActor`` (the
    options, which say where Ray places it, have nothing to say there)."""
    if inprocess:
        groups = dict(getattr(actor_class, "_default_options", {}).get("concurrency_groups") or {})
        return LocalActor(plain_class(actor_class), args, kwargs, concurrency_groups=groups)
    return actor_class.options(**options).remote(*args, **kwargs)


class _SerialThread:
    """One thread running submitted calls in order (``ThreadPoolExecutor`` joins its threads at interpreter
    exit, so a call stuck in a dead run's wait would hold the process open; this thread is a daemon)."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def stop(self) -> None:
        """Calls not yet started fail with ``RayActorError`` (a killed Ray actor's do); the thread then ends."""
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].set_exception(RayActorError(error_msg="in-process actor killed before this call ran"))
        self._calls.put(None)

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - the caller's get raises it, as Ray's does
                future.set_exception(e)


class _LoopThread:
    """An event loop on its own thread: an async actor's calls interleave at their awaits, as in Ray."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        # An async method gives a coroutine object (nothing has run yet); a plain one runs on the loop too.
        coro = fn(*args, **kwargs) if inspect.iscoroutinefunction(fn) else _on_loop(fn, *args, **kwargs)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        """Cancel what is pending (its callers' ``get`` raises ``RayActorError``), then end the loop."""
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks(self.loop) if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:  # a cancelled call needs a few loop turns to unwind into its caller's future
                await asyncio.wait(tasks, timeout=1.0)
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop)


async def _on_loop(fn, *args, **kwargs):
    return fn(*args, **kwargs)


class _Method:
    __slots__ = ("_actor", "_name")

    def __init__(self, actor: "LocalActor", name: str):
        self._actor, self._name = actor, name

    def remote(self, *args, **kwargs) -> LocalRef:
        return self._actor._call(self._name, args, kwargs)


class LocalActor:
    """An actor handle whose actor is a plain object in this process (see the module docstring)."""

    _ids = itertools.count()

    def __init__(self, cls: type, args: tuple, kwargs: dict, concurrency_groups: dict | None = None):
        self._cls = cls
        self._dead: str | None = None
        n = next(self._ids)
        self._is_async = any(inspect.iscoroutinefunction(f) for _, f in inspect.getmembers(cls, inspect.isfunction))
        # Built here, in the caller's thread, so a constructor error is raised where the actor is made.
        self._instance = cls(*args, **kwargs)
        if self._is_async:
            self._default = _LoopThread(f"{cls.__name__}-{n}")
            self._groups: dict = {}
        else:
            self._default = _SerialThread(f"{cls.__name__}-{n}")
            # Ray gives each group its own threads; every group here has max concurrency 1, as the shells use.
            self._groups = {g: _SerialThread(f"{cls.__name__}-{n}-{g}") for g in concurrency_groups or {}}

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("__") and name != "__ray_call__":
            raise AttributeError(name)
        if name != "__ray_call__" and not callable(getattr(self._cls, name, None)):
            raise AttributeError(f"{self._cls.__name__} has no method {name!r}")
        return _Method(self, name)

    def _call(self, name: str, args: tuple, kwargs: dict) -> LocalRef:
        if self._dead is not None:
            return LocalRef(_failed(RayActorError(error_msg=f"in-process actor {self._cls.__name__} is dead: "
                                                            f"{self._dead}")))
        if name == "__ray_call__":  # Ray's "run this function on the actor": fn(instance, *args)
            fn, args = args[0], args[1:]
            return LocalRef(self._default.submit(fn, self._instance, *args, **kwargs))
        method = getattr(self._instance, name)
        group = getattr(getattr(self._cls, name), "__ray_concurrency_group__", None)
        runner = self._groups.get(group, self._default)
        if any(_is_ref(a) for a in (*args, *kwargs.values())):
            # Ray passes a top-level ref argument as its value (refs inside lists stay refs): resolved when the
            # call runs, as Ray runs a task once its arguments exist. (A Ray ref too: a ``put`` made while this
            # process also happens to be connected to Ray.)
            if inspect.iscoroutinefunction(method):
                async def call(*a, **k):
                    return await method(*[await _value(x) for x in a], **{key: await _value(x) for key, x in k.items()})
            else:
                def call(*a, **k):
                    return method(*[get(x) if _is_ref(x) else x for x in a],
                                  **{key: get(x) if _is_ref(x) else x for key, x in k.items()})
            return LocalRef(runner.submit(call, *args, **kwargs))
        return LocalRef(runner.submit(method, *args, **kwargs))

    def kill(self) -> None:
        """Later calls raise ``RayActorError``; a call in progress runs on (a thread cannot be killed) on a
        daemon thread that does not hold the process open."""
        if self._dead is None:
            self._dead = "killed"
            for runner in (self._default, *self._groups.values()):
                runner.stop()

    def __repr__(self) -> str:
        return f"LocalActor({self._cls.__name__}{', dead' if self._dead else ''})"


def _is_ref(x) -> bool:
    return isinstance(x, (LocalRef, ray.ObjectRef))


async def _value(x):
    if isinstance(x, LocalRef):
        return await x
    if isinstance(x, ray.ObjectRef):
        return await asyncio.wrap_future(x.future())
    return x


def _failed(error: BaseException) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(error)
    return future
