"""Optional dependencies: the pyproject extras a feature needs, and the one line that names them.

The library (planner, CowClip, merger) needs only torch, torchrec/FBGEMM and a few small packages.
What only some commands use is an extra of the distribution, so a TorchRec user's environment does
not gain a launcher, a docker client or TensorBoard by installing it:

- ``[viz]``: TensorBoard events (``train.tensorboard``) and ``curves.png`` (``train.curves``);
- ``[launch]``: the TorchX launcher (``torchx run ... recsys.train``, docs/launch.md);
- ``[all]``: both.

A feature whose extra is missing stops with one line naming the extra (and how to do without
it), before any worker starts: never an ImportError traceback from inside a worker.
"""

from __future__ import annotations

import importlib.util

DISTRIBUTION = "torchrec-cowclip-trainer"


class MissingExtraError(ImportError):
    """A feature was asked for whose optional dependency is not installed."""


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (found on the path; not imported here)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install_hint(extra: str) -> str:
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def missing_extra(feature: str, module: str, extra: str, instead: str = "") -> str | None:
    """The one line saying that ``feature`` needs ``module`` (extra ``extra``), or None when it is
    installed. ``instead``: how to run without the feature, appended in parentheses."""
    if installed(module):
        return None
    line = f"{feature} needs the '{module}' package, which is not installed: {install_hint(extra)}"
    return f"{line} (or {instead})" if instead else line


def require(feature: str, module: str, extra: str, instead: str = "") -> None:
    """Raise :class:`MissingExtraError` with the one line of :func:`missing_extra`."""
    line = missing_extra(feature, module, extra, instead)
    if line:
        raise MissingExtraError(line)
