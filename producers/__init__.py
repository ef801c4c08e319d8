"""What a training job imports: publish per-step metrics, receive control commands.

The base install (kafka-python, numpy) is all this package needs. Nothing here connects
to Kafka in a constructor, and nothing here raises into the training loop.
"""

from __future__ import annotations

from producers.layers import layer_of, signal_info, split_metrics

__all__ = ["layer_of", "signal_info", "split_metrics"]
