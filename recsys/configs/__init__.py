"""The experiment configs that ship with the package (``recsys/configs/experiments/*.yaml``,
package data read through importlib.resources; ``configs/experiments`` in the repository links
here). They let ``--config demo`` work from a wheel install in any directory."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["shipped_experiment", "shipped_experiments"]


def _dir() -> Path:
    return Path(str(resources.files(__name__).joinpath("experiments")))


def shipped_experiments() -> list[str]:
    """Names of the shipped experiment configs (``demo``, ``smoke``, ...)."""
    return sorted(p.stem for p in _dir().glob("*.yaml"))


def shipped_experiment(name: str) -> Path | None:
    """The shipped config called ``name`` (``demo`` or ``demo.yaml``), or None if there is none."""
    stem = name[:-5] if name.endswith(".yaml") else name
    if not stem or "/" in stem or "\\" in stem or stem.startswith("."):
        return None
    p = _dir() / f"{stem}.yaml"
    return p if p.is_file() else None
