"""A session's configuration: its shape, its layers' kv formats and their exact rows
(``SessionKV`` builds its layers from it; pure, safe anywhere)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..pool import PageLayout

__all__ = ["SessionConfig", "layer_formats"]


def layer_formats(kv_format: str | Sequence[str], num_layers: int) -> tuple[str, ...]:
    """Each layer's kv format: ``kv_format`` is one for every layer, or one per layer."""
    if isinstance(kv_format, str):
        return (kv_format,) * num_layers
    return tuple(kv_format)


@dataclass
class SessionConfig:
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    kv_format: str | tuple[str, ...]  # one for every layer, or one per layer
    max_tokens: int
    seed: int
    # the compressed layers' exact rows (issue 27): their first ``sinks`` timesteps and
    # a recent ``window`` (WindowedLayerCache); 0 and 0: none
    sinks: int = 0
    window: int = 0

    @property
    def layer_formats(self) -> tuple[str, ...]:
        return layer_formats(self.kv_format, self.num_layers)

    @property
    def windowed(self) -> bool:
        """Its compressed layers keep exact sinks or a window (WindowedLayerCache)."""
        return bool(self.sinks or self.window)

    def layer_layout(self, layer: int) -> PageLayout:
        """How layer ``layer`` lays out its rows."""
        return PageLayout(self.layer_formats[layer], self.num_kv_heads, self.head_dim)
