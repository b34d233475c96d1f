"""Checkpoint-engine plugins for the tests (backends "plugin_engines:ClassName"): a loopback engine
that moves chunks between engines of this process through queues, built on refit's plugin ABC and
chunk helpers, and classes that are wrong on purpose."""

from __future__ import annotations

import queue
import uuid
from typing import Any, Dict, Optional

import refit


class LoopbackEngine(refit.CheckpointEngineBase):
    """Buckets of at most bucket_size chunk bytes, copied into the destination's queue."""

    _mailboxes: Dict[str, "queue.Queue"] = {}

    def __init__(self, bucket_size: int, release_after_refit: bool = False, **extra: Any):
        self.bucket_size = bucket_size
        self.release_after_refit = release_after_refit
        self.extra = extra
        self.name = uuid.uuid4().hex
        self.peer: Optional[str] = None

    def prepare(self) -> dict:
        self._mailboxes.setdefault(self.name, queue.Queue())
        return {"name": self.name}

    def init_policy_process_group(self, worker_rank, train_world_size, rollout_world_size, metadata) -> None:
        self.peer = metadata[train_world_size + worker_rank]["name"] if worker_rank < rollout_world_size else None

    def init_rollout_process_group(self, rollout_rank, train_world_size, rollout_world_size, metadata) -> None:
        self.peer = metadata[rollout_rank]["name"]

    def send_weights(self, weights) -> dict:
        if self.peer is None:
            for _ in weights:
                pass
            return {"buckets": 0}
        box = self._mailboxes[self.peer]
        bucket, used, sent = [], 0, 0
        for meta, chunk in refit.split_weight_chunks(weights, self.bucket_size):
            if used + meta.chunk_size > self.bucket_size:
                box.put(bucket)
                bucket, used, sent = [], 0, sent + 1
            bucket.append((meta, chunk.copy()))
            used += meta.chunk_size
        box.put(bucket)
        box.put(None)
        return {"buckets": sent + 1}

    def receive_weight_batches(self):
        box = self._mailboxes[self.name]

        def buckets():
            while True:
                bucket = box.get(timeout=20)
                if bucket is None:
                    return
                yield bucket

        return refit.merge_weight_chunk_batches(buckets())

    def finalize(self) -> None:
        self.peer = None


class ShardedLoopbackEngine(LoopbackEngine):
    def get_target_weight_layout(self):
        return {"sharded": True}


class IncompleteEngine(refit.CheckpointEngineBase):
    def prepare(self):
        return {}


class NotAnEngine:
    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs


not_a_class = 42
