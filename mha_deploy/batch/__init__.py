"""Offline batch inference: the batch planner, ``BatchRunner``, dataset readers and writers, resume, Ray. No torch."""

from mha_deploy.batch.runner import BatchRunner, RunStats

__all__ = ["BatchRunner", "RunStats"]
