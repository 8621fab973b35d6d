"""Export a trained policy as a graph that runs without this project (ONNX, or torch.export's .pt2).

    python -m cluster.export RUN_DIR_OR_CHECKPOINT --out policy.onnx [--format onnx|pt2] [--config C] [--trust-code]

The graph takes the model's inputs, one per modality (named as the modalities: ``vector`` for a Box env, the
env.modalities keys for a Dict env, after the rollouts' preprocessing) plus the action mask where the model reads
one (``env.action_mask_key``, bool), each with a leading batch dimension of any size. It returns ``action`` (the
deterministic action: the argmax of a Discrete space's logits, a Box space's mean, before clipping to the space),
``head`` (the policy head's raw output: logits or means) and ``value``. Observation normalisation (the model's
running statistics) is inside the graph, so raw Box observations go in as they come from the env.

A recurrent policy (``learner.rnn``) takes one more input, ``state`` (batch, state_size: a GRU's h, an LSTM's h and c
side by side), the state going into this step, and returns one more output, ``state_out``, the state going into
the next: the caller keeps it per env and passes zeros at an episode's first step (what ``Policy.reset`` does).
A composite action space (``Tuple``/``Dict``/``MultiDiscrete``/``MultiBinary``/shaped ``Box``) returns ``action`` as
the flat vector the fragments store (each part's mode: argmax choices, Bernoulli logits > 0, Gaussian means, in
the space's order); turning it into the env's own type stays outside the graph (``Policy.act`` does it).

ONNX needs the ``export`` extra (onnx, onnxscript; onnxruntime to check the file): after writing, the file is run
with onnxruntime on random inputs and compared with torch, and the largest difference is printed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path

import numpy as np

from cluster.config import ArgumentParser, ConfigError

EXIT_OK, EXIT_BAD_INPUT = 0, 2
FORMATS = ("onnx", "pt2")
OUTPUTS = ("action", "head", "value")
STATE_IN, STATE_OUT = "state", "state_out"


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # in sys.modules as None: blocked, as good as absent
        return False


def _graph_module(model):
    """The model as a module of positional tensors (the export formats' calling convention): the modalities, the
    action mask where the model reads one, and a recurrent model's state last. Returns (module, input names,
    output names)."""
    import torch

    from learner.model import parts_mode

    obs_names = [m.name for m in model.spec.modalities] + ([model.mask_key] if model.mask_key is not None else [])
    names = obs_names + ([STATE_IN] if model.recurrent else [])
    kind = model.spec.action_kind

    class ExportedPolicy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            obs = dict(zip(obs_names, inputs))
            if self.model.recurrent:
                head, value, state = self.model._heads(obs, inputs[-1])
            else:
                head, value = self.model._heads(obs)
            if kind == "discrete":
                action = head.argmax(dim=-1)
            elif kind == "composite":
                action = parts_mode(self.model.parts, head)
            else:
                action = head
            return (action, head, value, state) if self.model.recurrent else (action, head, value)

    outputs = list(OUTPUTS) + ([STATE_OUT] if model.recurrent else [])
    return ExportedPolicy().eval(), names, outputs


def example_inputs(model, batch: int = 2, seed: int | None = None) -> tuple:
    """Inputs of the model's shapes and dtypes: zeros, or random values (all actions legal) with ``seed``."""
    import torch

    g = None if seed is None else torch.Generator().manual_seed(seed)
    out = []
    for m in model.spec.modalities:
        dtype = getattr(torch, m.dtype)
        if g is None:
            out.append(torch.zeros((batch,) + tuple(m.shape), dtype=dtype))
        elif m.categories:  # ids below each channel's count (the model one-hots them)
            counts = torch.tensor(m.categories, dtype=torch.float32)
            out.append((torch.rand((batch,) + tuple(m.shape), generator=g) * counts).floor().to(dtype))
        elif dtype.is_floating_point:
            out.append(torch.randn((batch,) + tuple(m.shape), generator=g).to(dtype))
        else:
            out.append(torch.randint(0, 255, (batch,) + tuple(m.shape), generator=g).to(dtype))
    if model.mask_key is not None:
        out.append(torch.ones(batch, model.spec.mask_width, dtype=torch.bool))
    if model.recurrent:  # a state mid-episode (random), or the first step's zeros
        out.append(torch.zeros(batch, model.spec.state_size) if g is None
                   else torch.randn(batch, model.spec.state_size, generator=g))
    return tuple(out)


def export(policy, out: str | Path, fmt: str = "onnx") -> dict:
    """Write ``policy`` (a ``cluster.api.Policy``) to ``out``; -> {path, format, inputs, outputs, max_abs_diff}
    (the check against torch: ONNX with onnxruntime when installed, pt2 by loading it back)."""
    import torch

    model = policy.model.cpu().eval()
    if getattr(model, "names", None) is not None:
        raise ConfigError(f"the run has several policies ({', '.join(model.names)}), exported one at a time; "
                          f"allowed: --policy NAME")
    if fmt not in FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not a format; allowed: {', '.join(FORMATS)}")
    if fmt == "onnx":
        missing = [m for m in ("onnx", "onnxscript") if not _installed(m)]
        if missing:
            raise ConfigError(f"--format onnx: needs {' and '.join(missing)} (pip install -e '.[export]'); "
                              f"allowed: --format pt2, which needs only torch")
    module, names, outputs = _graph_module(model)
    args = example_inputs(model)
    batch = torch.export.Dim("batch", min=1)
    dynamic = (tuple({0: batch} for _ in args),)  # forward(*inputs): one varargs parameter
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's deprecation notes about its own internals
        if fmt == "onnx":
            torch.onnx.export(module, args, str(out), input_names=names, output_names=outputs,
                              dynamic_shapes=dynamic, dynamo=True, verbose=False)
        else:
            torch.export.save(torch.export.export(module, args, dynamic_shapes=dynamic), str(out))
    return {"path": str(out), "format": fmt, "inputs": names, "outputs": outputs,
            "max_abs_diff": check(module, out, fmt, names, model)}


def check(module, path: Path, fmt: str, names: list[str], model) -> float | None:
    """The largest difference between the exported graph and torch on 5 random inputs (None: no onnxruntime)."""
    import torch

    inputs = example_inputs(model, batch=5, seed=0)
    with torch.no_grad():
        expected = [t.float().numpy() for t in module(*inputs)]
    if fmt == "onnx":
        if not _installed("onnxruntime"):
            return None
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = session.run(None, {n: t.numpy() for n, t in zip(names, inputs)})
    else:
        with torch.no_grad():
            got = [t.detach().numpy() for t in torch.export.load(str(path)).module()(*inputs)]
    return float(max(np.abs(np.asarray(g, dtype=np.float64) - e).max() for g, e in zip(got, expected)))


def writable_file(out: str) -> Path:
    """``out`` as a file path this process can write (its directory made if missing), or a ConfigError naming
    --out, before anything is loaded or exported."""
    path = Path(out)
    try:
        if path.is_dir():
            raise IsADirectoryError("a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise PermissionError("not writable by this user")
    except OSError as e:
        reason = e.strerror or str(e)
        raise ConfigError(f"--out: {out!r} cannot be written ({type(e).__name__}: {reason}); allowed: a file path "
                          f"in a directory this process can create and write") from None
    return path


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m cluster.export", description=__doc__.splitlines()[0])
    p.add_argument("run", help="a run directory (its newest checkpoint) or a checkpoint file")
    p.add_argument("--out", required=True, help="where the exported policy goes")
    p.add_argument("--format", default=None, choices=FORMATS, help="default: from --out's suffix (.onnx, .pt2)")
    p.add_argument("--config", default=None, help="the config to build the model from (default: the checkpoint's)")
    p.add_argument("--trust-code", action="store_true",
                   help="let the checkpoint's own config import the modules its env id and wrappers name")
    p.add_argument("--policy", default=None, help="a run with several policies (multiagent.policies): export this "
                                                  "one (its input: the agent's observation, padded to the widest)")
    args = p.parse_args(argv)
    fmt = args.format or (Path(args.out).suffix.lstrip(".") or "onnx")
    try:
        from cluster.api import load_policy

        writable_file(args.out)
        policy = load_policy(args.run, config=args.config, trust_code=args.trust_code, policy=args.policy)
        result = export(policy, args.out, fmt)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # checked above: a disk that filled, a directory removed meanwhile
        print(f"export failed: --out {args.out!r} could not be written ({type(e).__name__}: {e.strerror or e}); "
              f"nothing else was changed", file=sys.stderr)
        return EXIT_BAD_INPUT
    diff = result["max_abs_diff"]
    checked = "not checked (onnxruntime not installed)" if diff is None else f"max |difference| to torch {diff:.2e}"
    print(f"exported {result['format']} to {result['path']}: inputs {', '.join(result['inputs'])} -> outputs "
          f"{', '.join(result['outputs'])}; {checked}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
