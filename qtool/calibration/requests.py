"""What one calibration pass must collect, gathered before it starts.

The plan asks for activation ranges (and GPTQ's Hessians, a weight method of the plan); an
algorithm that needs data from the same pass adds its own request (SmoothQuant: per-channel
statistics of the inputs it may smooth). Collecting every request in one streaming pass is what
keeps calibration at one inference's cost, and asking up front is what lets the pass refuse a
combination it cannot serve (a sharded run of SmoothQuant) before it reads any data.
"""

from __future__ import annotations

from dataclasses import dataclass

from qtool.calibration.channels import ChannelObserver
from qtool.plan.layout import Layout


@dataclass(frozen=True)
class StatisticRequests:
    ranges: tuple[str, ...] = ()  # tensors whose min/max and histogram give activation ranges
    hessians: tuple[str, ...] = ()  # layer inputs whose XᵀX GPTQ rounds weights against
    channels: tuple[tuple[str, int], ...] = ()  # (tensor, rows kept) per-channel min/max
    # who asked for `channels`, for errors about what a sharded pass cannot merge
    channels_for: str = ""

    def __or__(self, other: StatisticRequests) -> StatisticRequests:
        return StatisticRequests(
            tuple(dict.fromkeys(self.ranges + other.ranges)),
            tuple(dict.fromkeys(self.hessians + other.hessians)),
            tuple(dict.fromkeys(self.channels + other.channels)),
            self.channels_for or other.channels_for,
        )

    @property
    def needs_data(self) -> bool:
        """Weight-only round-to-nearest needs none: the pass then reads no batch at all."""
        return bool(self.ranges or self.hessians or self.channels)

    def channel_observers(self) -> list[ChannelObserver]:
        return [ChannelObserver(tensor, rows) for tensor, rows in self.channels]


def plan_requests(layout: Layout) -> StatisticRequests:
    """The statistics the plan itself needs: ranges of its activation slots, GPTQ's Hessians."""
    return StatisticRequests(tuple(layout.stats_tensors()), tuple(layout.hessian_tensors()))
