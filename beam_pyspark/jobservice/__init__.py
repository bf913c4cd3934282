"""Beam's Job API: job lifecycle, state and message streams, job store.

Knows nothing of Spark: the executor is handed to it.
"""
