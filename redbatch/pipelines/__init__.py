"""Pipelines: chains of models served under a name of their own, each stage batching on
its own queue, handed on from stage to stage through Redis (``docs/protocol.md`` §17)."""

from redbatch.pipelines.definition import Pipeline

__all__ = ["Pipeline"]
