"""Second preprocessing tier: a Ray actor on a CPU host that runs slow modalities' preprocessing.

With many heavy modalities one rollout process is not enough CPU, however its
threads are scheduled. ``preprocess.remote_actors: K`` starts K of these; each
rollout actor sends its slow jobs to one of them (``ObservationPipeline`` with
``remote=``): the rollout's slow-queue thread waits on the call, GIL released,
while the work runs in another process, possibly on another host. Fast
modalities stay in the rollout actor: a round trip per env step would cost
more than decoding a small camera frame.

Plain class under a thin Ray shell, like the other actors.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import ray

from actors.envs import make_env, make_vector_env
from pipeline.contract import ModalitySpec, specs_from
from pipeline.modality import make_processor


class PreprocessWorker:
    def __init__(self, env_id: str, modalities: Mapping[str, ModalitySpec | dict],
                 max_episode_steps: int | None = None, env_kwargs: dict | None = None, wrappers=(), seed: int = 0,
                 multiagent: Mapping | None = None, backend: str = "gymnasium", isolation: Mapping | None = None):
        """``isolation``: env.isolation's settings (``actors.envs.make_vector_env``): under process the observation
        space comes from a sandboxed child, and the env's code never runs in this worker."""
        # Only for its (wrapped) observation space.
        if isolation is not None:
            env = make_vector_env(env_id, 1, max_episode_steps, env_kwargs, wrappers, multiagent, backend, isolation)
        else:
            env = make_env(env_id, max_episode_steps, env_kwargs, wrappers, multiagent, backend)
        try:
            space = env.single_observation_space if isolation is not None else env.observation_space
            self.processors = {spec.name: make_processor(spec, space[spec.name], seed=seed)
                               for spec in specs_from(modalities)}
        finally:
            env.close()
        self.jobs = 0
        self.items = 0

    def process(self, name: str, column: list) -> np.ndarray:
        self.jobs += 1
        self.items += len(column)
        return self.processors[name].batch(column)

    def stats(self) -> dict:
        return {"jobs": self.jobs, "items": self.items}


RemotePreprocessWorker = ray.remote(max_restarts=0, enable_task_events=False)(PreprocessWorker)
