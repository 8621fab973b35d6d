"""Batched rollout inference (``rollout.inference: remote``): the policy forward of many rollout actors in one batch.

One ``InferenceServer`` per rollout node (the anchors: SEED RL's central inference, Sample Factory's policy workers)
runs the model's heads (``ActorCritic._heads``: the policy head's output and the value) for every request queued
while the device was busy, as one batch, on the node's accelerator when the node has one (``learner.device``'s kind
where the server's process sees it: ``learner.device.for_inference``), on the CPU otherwise. The rollout actor
samples from the head's output itself (``ActorCritic._act_from``) with its own generator, so the random draws, their
order and the actions are the local copy's: remote inference changes where the arithmetic runs, not what is drawn
(on an accelerator the heads differ from the CPU's in the last bits, or more where convolutions run in TF32, as
CUDA's do by default; the log-probs stored are always those of the actions drawn).

Versions: every request names the policy version the actor's tickets were issued for, and is answered with that
version's weights. The server keeps the newest ``max_policy_lag + 1`` versions it was asked for (the most that
tickets let actors hold at once; older ones are evicted, their modules reused for the next); a request for a
version it does not hold is answered with ``None``, and the actor sends the same request once more with the weights
it loaded for that version. So weights cross to the server once per version (per server), from whichever actor
asked first, and nothing is pushed to a server that no actor uses.

Deadlines: an actor waits ``INFERENCE_TIMEOUT_S`` for an answer. A server that is dead, stopped or overloaded past
it costs the actor that wait once: the step is served by the actor's local CPU copy (the same weights: same
actions), and so is every step for ``INFERENCE_RETRY_S`` after (``inference_fallbacks`` counts the steps served so).
A dead server is restarted by Ray in place (``max_restarts``): it starts empty and loads versions as they are asked
for, so nothing else has to know it died.

``InferenceServer`` is the plain class (an asyncio one: the requests queue on its loop while the device works on a
thread of its own); ``RemoteInferenceServer`` its Ray shell; ``InferenceClient`` the actor's side.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Callable

import numpy as np
import ray
import torch

from pipeline import runtime

#: How long a rollout actor waits for the server's answer to one step. Far above a batched forward of every actor of
#: a node (milliseconds, even on a loaded CPU), and far below the fragment lease (rollout.fragment_timeout_s, at
#: least 10 s under auto): a server that stops answering costs a fragment one such wait per INFERENCE_RETRY_S,
#: never its ticket.
INFERENCE_TIMEOUT_S = 2.0

#: After a failed or late answer the actor serves its steps from its local copy this long before it asks the server
#: again: a stopped server then costs each actor at most one timeout per interval (under 1/5 of its time), and a
#: restarted one is back in use within it.
INFERENCE_RETRY_S = 10.0

#: A request that outlived INFERENCE_TIMEOUT_S is kept, not given up: the server may be compiling (on an NPU the
#: first call of each batch shape compiles its kernels, for far longer than a step's wait). Until it answers the
#: actor serves its steps locally without asking again, so a compiling server costs each actor one
#: INFERENCE_TIMEOUT_S wait, not one every INFERENCE_RETRY_S; it asks again once that request answered (and the
#: retry interval passed), or after this long without an answer: a wedged server, not a compiling one.
INFERENCE_COLD_START_S = 600.0


class InferenceServer:
    """The policy heads for requests from many rollout actors, batched per version.

    ``policy_factory``: builds the model (the rollout actors' own, ``learner.model.build_model`` of the spec);
    ``device_factory``: () -> the device spec this server runs on, bound to the calling thread
    (``learner.device.for_inference``; None: the CPU); ``max_versions``: policy versions held at once.
    """

    def __init__(self, policy_factory: Callable[[], torch.nn.Module], device_factory: Callable | None = None,
                 max_versions: int = 2, torch_threads: int = 1):
        if max_versions < 1:
            raise ValueError(f"max_versions: {max_versions} is not allowed; allowed: >= 1 (replay.max_policy_lag + 1)")
        torch.set_num_threads(torch_threads)
        self.policy_factory = policy_factory
        self.max_versions = max_versions
        self.device_factory = device_factory
        # One thread does all device work: the device is bound once there, and batches never interleave on it.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="inference",
                                                               initializer=self._bind)
        self.device = self._executor.submit(lambda: self._device).result()
        self._models: dict[int, torch.nn.Module] = {}  # version -> model on the device, at most max_versions
        self._queue: list = []  # (version, obs, weights or None, future) waiting for the device
        self._draining = False
        self.counts = {"requests": 0, "batches": 0, "rows": 0, "loads": 0, "misses": 0}

    def _bind(self) -> None:
        self._spec = self.device_factory() if self.device_factory is not None else None
        self._device = self._spec.torch_device() if self._spec is not None else torch.device("cpu")

    async def infer(self, version: int, obs: dict[str, np.ndarray], weights: dict | None = None):
        """(policy head output (B, head width) float32, value (B,) float32) of ``obs`` under policy ``version``;
        None when this server does not hold that version and ``weights`` (that version's state dict) were not sent.
        Requests that arrive while a batch runs go together into the next one."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append((version, obs, weights, future))
        self.counts["requests"] += 1
        if not self._draining:
            self._draining = True
            loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                answers = await loop.run_in_executor(self._executor, self._run, [b[:3] for b in batch])
                for (*_, future), (ok, answer) in zip(batch, answers):
                    if not future.done():
                        (future.set_result if ok else future.set_exception)(answer)
        finally:
            self._draining = False

    def _run(self, batch: list) -> list:
        """On the device thread: every request of ``batch``, grouped by version, one forward per version."""
        answers: list = [(True, None)] * len(batch)
        groups: dict[int, list[int]] = {}
        for i, (version, _, _) in enumerate(batch):
            groups.setdefault(version, []).append(i)
        for version, rows in groups.items():
            try:
                model = self._model(version, next((batch[i][2] for i in rows if batch[i][2] is not None), None))
                if model is None:
                    self.counts["misses"] += len(rows)
                    continue
                sizes = [len(next(iter(batch[i][1].values()))) for i in rows]
                obs = {k: torch.from_numpy(np.concatenate([batch[i][1][k] for i in rows]))
                       for k in batch[rows[0]][1]}
                with torch.inference_mode():
                    out, value = model._heads(obs)
                out, value = out.float().cpu().numpy(), value.float().cpu().numpy()
                self.counts["batches"] += 1
                self.counts["rows"] += int(sum(sizes))
                start = 0
                for i, n in zip(rows, sizes):
                    answers[i] = (True, (out[start:start + n].copy(), value[start:start + n].copy()))
                    start += n
            except Exception as e:  # noqa: BLE001 - this version's callers get it (and use their local copy)
                for i in rows:
                    answers[i] = (False, e)
        return answers

    def _model(self, version: int, weights: dict | None) -> torch.nn.Module | None:
        model = self._models.get(version)
        if model is not None or weights is None:
            return model
        if len(self._models) >= self.max_versions:
            model = self._models.pop(min(self._models))  # the oldest version's module takes the new weights
        else:
            model = self.policy_factory().to(self._device).eval()
        # torch.tensor copies: the arrays may be read-only views of the object store.
        model.load_state_dict({k: torch.tensor(v) for k, v in weights.items()})
        self._models[version] = model
        self.counts["loads"] += 1
        return model

    def stats(self) -> dict:
        """Requests, batches, rows and version loads so far; the versions held and the device."""
        return {**self.counts, "versions": sorted(self._models), "device": str(self.device)}


# An async actor: its calls wait on its loop, so requests queue while the device runs a batch. max_restarts: a dead
# server comes back empty in place and loads the versions asked of it (its actors use their local copies meanwhile);
# max_task_retries 0: a step's request is never run twice, the actor has already answered it locally.
RemoteInferenceServer = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0,
                                   enable_task_events=False)(InferenceServer)


class InferenceClient:
    """A rollout actor's side: the heads from the server, or None (the caller then runs its local copy)."""

    def __init__(self, server, timeout_s: float = INFERENCE_TIMEOUT_S, retry_s: float = INFERENCE_RETRY_S):
        self.server = server
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.calls = 0  # steps the server answered
        self.fallbacks = 0  # steps the local copy served because the server failed, was late, or is waited out
        self.error: str | None = None  # the last failure, in words
        self.late = 0  # answers waited for past timeout_s (each one such wait)
        self._retry_at = 0.0
        self._pending = None  # the request that was late, while the server may still be working on it
        self._pending_until = 0.0

    def heads(self, version: int, obs: dict[str, np.ndarray], weights: dict) -> tuple | None:
        """(policy head output, value) as tensors, from the server; None when the local copy must serve the step."""
        now = time.monotonic()
        if self._pending is not None:  # a late request: not asked again, nor waited for, until it answers
            answered, _ = runtime.wait([self._pending], timeout=0)
            if not answered and now < self._pending_until:
                self.fallbacks += 1
                return None
            self._pending = None
        if now < self._retry_at:
            self.fallbacks += 1
            return None
        ref = None
        try:
            ref = self.server.infer.remote(version, obs)
            answer = runtime.get(ref, timeout=self.timeout_s)
            if answer is None:  # the server does not hold this version (new, or it restarted): once with the weights
                ref = self.server.infer.remote(version, obs, weights)
                answer = runtime.get(ref, timeout=self.timeout_s)
                if answer is None:
                    raise RuntimeError(f"the inference server did not load policy version {version}")
        except Exception as e:  # noqa: BLE001 - dead, stopped, late or failed: the local copy serves
            self.fallbacks += 1
            self.error = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            self._retry_at = time.monotonic() + self.retry_s
            if "Timeout" in type(e).__name__ and ref is not None:  # late, maybe compiling: kept
                self.late += 1
                self._pending, self._pending_until = ref, time.monotonic() + INFERENCE_COLD_START_S
            return None
        self.calls += 1
        out, value = answer
        # Writable copies where the transport gave read-only views (torch refuses to wrap those without a warning).
        return torch.from_numpy(np.require(out, requirements="W")), torch.from_numpy(np.require(value,
                                                                                                requirements="W"))

    def stats(self) -> dict:
        return {"inference_calls": self.calls, "inference_fallbacks": self.fallbacks, "inference_error": self.error}
