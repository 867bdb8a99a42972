"""Beyond one process: tensor parallelism and disaggregated prefill/decode on torch.distributed."""

from ioattn.distributed.disagg import DisaggregatedEngine
from ioattn.distributed.tp import ShardPlan, load_tensor_parallel
from ioattn.distributed.worker import TensorParallelEngine, WorkerDiedError

__all__ = ["DisaggregatedEngine", "ShardPlan", "TensorParallelEngine", "WorkerDiedError", "load_tensor_parallel"]
