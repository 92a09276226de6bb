"""A Lightning logger that keeps what it is sent, for tests that read logged values back."""

from typing import Any

from pytorch_lightning.loggers import Logger


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call as ``(step, metrics)`` in :attr:`calls`; :attr:`latest` merges them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    @property
    def latest(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for _, metrics in self.calls:
            merged.update(metrics)
        return merged

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))
