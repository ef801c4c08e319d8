"""The one small contract every detector follows (modelled on river's anomaly detectors)."""

from __future__ import annotations

import abc
import copy
from typing import Any

__all__ = ["Detector"]


class Detector(abc.ABC):
    """An online, single-signal anomaly detector.

    - ``learn_one(x)`` folds one value into the state (O(1) time and memory).
    - ``score_one(x)`` says how anomalous ``x`` is given what was learned so far, higher is
      more anomalous, ``0.0`` before any learning; it never mutates the detector.
    - Constructor arguments are stored under their own names; learned state is private,
      so ``clone()`` gives a fresh detector with the same parameters and the whole object
      pickles (detector state lives in Faust tables).
    - Non-finite input: ``score_one`` of NaN/inf returns ``0.0`` (non-finite values are the
      job of :class:`~detectors.nonfinite.NonFinite`), and ``learn_one`` ignores them.
    """

    @abc.abstractmethod
    def learn_one(self, x: float) -> None:
        """Update the state with one value."""

    @abc.abstractmethod
    def score_one(self, x: float) -> float:
        """How anomalous ``x`` is; >= 0, higher is more anomalous."""

    def _get_params(self) -> dict[str, Any]:
        import inspect

        sig = inspect.signature(type(self).__init__)
        return {name: getattr(self, name) for name in sig.parameters
                if name != "self" and hasattr(self, name)}

    def clone(self) -> Detector:
        """A fresh, unlearned detector with the same parameters."""
        return type(self)(**copy.deepcopy(self._get_params()))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._get_params().items())
        return f"{type(self).__name__}({params})"
