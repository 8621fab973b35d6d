"""The one error a bad setting raises, defined where every package can import it.

``cluster.config`` raises it for the config file and re-exports it (``from cluster.config import ConfigError`` is
how callers name it); ``actors.envs`` raises it for an env the config cannot make. It lives below both so that
nothing in ``actors/``, ``learner/`` or ``pipeline/`` imports ``cluster/`` (tests/test_imports.py). Standard
library only.
"""

from __future__ import annotations

import re

#: Longest error line: a message quotes the bad value, and a value can be megabytes (an alias bomb's expansion, a
#: pasted file); the head names the key and the tail says what is allowed, so the middle goes.
MAX_ERROR_CHARS = 1000


class ConfigError(ValueError):
    """A bad setting. ``str(err)`` is the one-line message shown to the user."""

    def __init__(self, message: str):
        # One line, whatever the input held (a key or value with a newline, a multi-line parser message).
        text = re.sub(r"\s*[\r\n]+\s*", " ", str(message)).strip()
        if len(text) > MAX_ERROR_CHARS:
            head, tail = MAX_ERROR_CHARS * 2 // 3, MAX_ERROR_CHARS // 4
            text = f"{text[:head]} ... [{len(text) - head - tail:,} characters left out] ... {text[-tail:]}"
        super().__init__(text)


#: The pyproject extra that installs each optional package an env or a setting may need (its top-level module):
#: the core install (``pip install -e .``, what ``make train`` runs) trains the default config and nothing more.
EXTRAS = {
    "cv2": "multimodal",
    "minigrid": "minigrid",
    "mujoco": "mujoco",
    "ale_py": "atari",
    "envpool": "envpool",
    "pettingzoo": "multiagent",
    "mpe2": "multiagent",
    "pygame": "multiagent",
    "moviepy": "video",
    "onnx": "export",
    "onnxscript": "export",
    "onnxruntime": "export",
    "wandb": "wandb",
    "mlflow": "mlflow",
}


def install_hint(error: BaseException) -> str:
    """``"; install the <extra> extra: pip install -e '.[<extra>]'"`` when ``error`` says an optional package is
    missing (an ImportError naming its module, as its ``name`` or in its text where a wrapper re-raised it, as
    gymnasium's registry does; gymnasium's DependencyNotInstalled naming it in its text), else ``""``, and ``""``
    when the message already says what to install."""
    text = str(error)
    if "pip install -e" in text:
        return ""
    found = re.findall(r"(?:No module named '|import of )([\w.]+)", text)
    names = [n.split(".")[0] for n in (getattr(error, "name", None) or "", *found) if n]
    if type(error).__name__ == "DependencyNotInstalled":
        names += [word.strip("`'\".,():").lower() for word in text.split()]
    extra = next((EXTRAS[n] for n in names if n in EXTRAS), None)
    return f"; install the {extra} extra: pip install -e '.[{extra}]'" if extra else ""
