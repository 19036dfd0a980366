"""Black-box input canaries for one-run audits (:class:`InputCanaries`): held-out examples given a
wrong label, each included in the training set with probability ½ and scored by the logit-scaled
confidence of the wrong label under the final model. Each is a record like any other, audited
under the run's add/remove-one guarantee; an excluded canary stays in the dataset with weight 0
(an exactly zero gradient), so the sampling rate does not depend on the bits. The soundness
argument shared with the gradient canaries is in :mod:`veil.audit.canaries`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from veil.audit.bounds import OneRunBound, bound_from_scores
from veil.audit.canaries import check_count
from veil.errors import InvalidParameterError

if TYPE_CHECKING:
    from torch import nn

    from veil.mechanisms.rng import RandomSource

__all__ = ["InputCanaries", "max_input_canaries"]


def max_input_canaries(held_out: int) -> int:
    """Input canaries come from held-out examples; half stay clean non-members for the attacks."""
    return max(0, held_out // 2)


class InputCanaries:
    """Black-box input canaries: held-out examples with a wrong label, each in the data w.p. ½."""

    def __init__(self, x: np.ndarray, y: np.ndarray, source: np.ndarray, included: np.ndarray) -> None:
        self.x = x
        self.y = y
        self.source = source  # indices into the held-out set they were taken from
        self.included = np.asarray(included, dtype=bool)
        self.count = int(self.included.size)
        self._scores: np.ndarray | None = None

    @classmethod
    def design(
        cls, x_held: np.ndarray, y_held: np.ndarray, count: int, num_classes: int, *, rng: RandomSource
    ) -> InputCanaries:
        """Take ``count`` held-out examples at random and give each a random wrong label."""
        count = check_count("canaries", count)
        limit = max_input_canaries(len(y_held))
        if count > limit:
            raise InvalidParameterError(
                "canaries",
                count,
                f"input canaries are held-out examples and there are {len(y_held)}; half must stay clean "
                "non-members for the membership attacks",
                f"pass --canaries ≤ {limit}, or use gradient canaries",
            )
        if num_classes < 2:
            raise InvalidParameterError(
                "num_classes", num_classes, "a wrong label needs a second class", "use labelled data"
            )
        source = np.argsort(rng.uniform(len(y_held)), kind="stable")[:count]
        shift = np.asarray(rng.integers(1, num_classes, size=count))
        labels = (np.asarray(y_held)[source].astype(np.int64) + shift) % num_classes
        included = rng.bernoulli(count, 0.5)
        return cls(np.asarray(x_held)[source], labels, source, included)

    def weights(self) -> np.ndarray:
        """Per-canary training weight: 1 if included, 0 if not (an exactly zero gradient)."""
        return self.included.astype(np.float32)

    def score(self, model: nn.Module, *, device: str = "cpu") -> np.ndarray:
        """Logit-scaled confidence of each canary's (wrong) label under the trained model."""
        from veil.audit.mia import logit_confidence, model_logits

        self._scores = logit_confidence(model_logits(model, self.x, device=device), self.y)
        return self._scores

    def bound(self, confidence: float = 0.95, *, delta: float = 0.0, share: int = 1) -> OneRunBound:
        if self._scores is None:
            raise InvalidParameterError(
                "canaries", "not scored", "score the canaries on the trained model first", "call score(model)"
            )
        return bound_from_scores(self._scores, self.included, confidence=confidence, delta=delta, share=share)

    def summary(self) -> dict[str, Any]:
        return {
            "kind": "input",
            "count": self.count,
            "included": int(self.included.sum()),
            "score": "confidence",
        }
