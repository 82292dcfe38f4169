"""Seeing a run: throughput, FLOPs and MFU, the anatomy of a step, peak memory, the learning
rate.

``ThroughputMonitor`` is a Trainer hook (NNHandler adds one unless ``logging.monitor`` is
off); ``LearningRateMonitor`` logs each optimizer step's learning rate (``logging.log_lr:
step``); ``anatomy``, ``flops`` and ``memory`` are the monitor's pure and device-facing parts.
"""

from nn_handler.monitoring.anatomy import DOMINANT, StepTimes, verdict
from nn_handler.monitoring.flops import PEAK_TFLOPS, FlopCount, peak_tflops
from nn_handler.monitoring.learning_rate import LearningRateMonitor
from nn_handler.monitoring.memory import peak_memory_bytes, reset_peak_memory
from nn_handler.monitoring.throughput import RECORD_KEYS, ThroughputMonitor

__all__ = [
    "DOMINANT",
    "PEAK_TFLOPS",
    "RECORD_KEYS",
    "FlopCount",
    "LearningRateMonitor",
    "StepTimes",
    "ThroughputMonitor",
    "peak_memory_bytes",
    "peak_tflops",
    "reset_peak_memory",
    "verdict",
]
