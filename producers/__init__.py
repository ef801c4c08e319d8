"""What a training job imports: publish per-step metrics, receive control commands.

The base install (kafka-python, numpy) is all this package needs. Nothing here connects
to Kafka in a constructor, and nothing here raises into the training loop.
"""

from __future__ import annotations

from producers.control import CommandVerifier, ControlListener
from producers.kafka import KafkaOptions, make_sender
from producers.layers import layer_of, signal_info, split_metrics
from producers.producer import MetricsProducer, ProducerStats

__all__ = [
    "MetricsProducer",
    "ProducerStats",
    "ControlListener",
    "CommandVerifier",
    "KafkaOptions",
    "make_sender",
    "layer_of",
    "signal_info",
    "split_metrics",
]
