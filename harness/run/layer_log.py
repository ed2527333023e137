"""One line per finished layer for logs (CI, remote jobs, a GPU machine's output), with the time left.

A live progress bar is lost in a log, so `run` and `attribute` print a line per layer there. At Flash width a run
takes minutes and an attribution tens of minutes, and a layer's time depends on its kind: on an H100 an attribution's
CSA layers took 38–42 s and its HCA layers 28–32 s (README, Benchmarks), and the first CSA layer 62 s with the
Triton compiles. So the time left is estimated per kind — the median of the finished layers of each remaining
layer's kind (robust to that first layer), or of all finished layers for a kind not seen yet — not as the mean of
all layers times the layers left.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


class LayerLog:
    """The lines of one pass over the layers (a run's, or one of an attribution's passes)."""

    def __init__(self, suffix: str = "", t0: float | None = None) -> None:
        """`suffix`: said after the elapsed time (e.g. ", 2 ranks"); `t0`: the perf_counter the elapsed time counts
        from (default: now)."""
        self.t0 = time.perf_counter() if t0 is None else t0
        self.suffix = suffix
        self._seconds: dict[str, list[float]] = {}
        self._last_layer = -1

    def new_pass(self) -> None:
        """A new pass over the layers (an attribution's second, seen as a layer that does not follow the last one):
        its layers' times are its own; the elapsed time goes on."""
        self._seconds.clear()

    def line(self, event: dict[str, Any]) -> str:
        """The line for a runner's `layer_done` event (its `kinds`: each layer's kind, when the runner gives them)."""
        layer, n_layers, seconds = event["layer"], event["layers"], event["seconds"]
        if layer <= self._last_layer:
            self.new_pass()
        self._last_layer = layer
        kinds = event.get("kinds")
        text = (f"layer {layer + 1}/{n_layers} done in {seconds:.1f} s "
                f"({time.perf_counter() - self.t0:.0f} s elapsed{self.suffix}")
        if kinds is None:
            return text + ")"
        self._seconds.setdefault(kinds[layer], []).append(seconds)
        left = self.seconds_left(kinds[layer + 1:n_layers])
        return text + (f"; ≈ {format_duration(left)} left)" if layer + 1 < n_layers else ")")

    def seconds_left(self, kinds: list[str] | tuple[str, ...]) -> float:
        """The estimated seconds of layers of these kinds, from the layers finished so far."""
        every = [s for seconds in self._seconds.values() for s in seconds]
        return sum(statistics.median(self._seconds.get(kind) or every) for kind in kinds) if every else 0.0


def format_duration(seconds: float) -> str:
    """75 -> "75 s", 754 -> "12.6 min", 5400 -> "1.5 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
