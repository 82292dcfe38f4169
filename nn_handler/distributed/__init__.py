"""Distributed building blocks and the functional API of seeds 000 and 004.

``from nn_handler.distributed import get_rank, all_gather, init_dist, ...`` works as the seeds
document (dist_utils names of seed 000, helios.core.distributed names of seed 004).
"""

from torch.distributed.elastic.multiprocessing.errors import record

from nn_handler.distributed.communicator import (
    Communicator,
    NullCommunicator,
    ReduceOp,
    TorchCommunicator,
)
from nn_handler.distributed.context import DistributedContext
from nn_handler.distributed.decorators import main_process_first, on_rank
from nn_handler.distributed.device import resolve_device
from nn_handler.distributed.env import (
    DistributedInfo,
    expand_slurm_nodelist,
    parse_distributed_env,
)
from nn_handler.distributed.functional import (
    all_gather,
    all_reduce_tensors,
    communicator,
    gather,
    gather_into_tensor,
    get_dist_info,
    get_global_rank,
    get_local_rank,
    get_local_size,
    get_local_world_size,
    get_rank,
    get_world_size,
    is_dist_active,
    is_main_process,
    is_using_torchrun,
    reduce_dict,
    safe_barrier,
    shared_random_seed,
    synchronize,
)
from nn_handler.distributed.launcher import launch, launch_distributed_training
from nn_handler.distributed.lifecycle import (
    init_dist,
    initialize_ddp,
    should_use_distributed,
    shutdown_dist,
)
from nn_handler.distributed.local_groups import (
    create_local_process_group,
    destroy_local_process_group,
    get_local_process_group,
)
from nn_handler.distributed.parallel import (
    ParallelExecutor,
    parallel_on_all_devices,
    parallelize_on_gpus,
)
from nn_handler.distributed.printing import (
    global_print,
    local_print,
    print_gpu_memory_stats,
    print_gpu_memory_usage,
)

__all__ = [
    "Communicator",
    "DistributedContext",
    "DistributedInfo",
    "NullCommunicator",
    "ParallelExecutor",
    "ReduceOp",
    "TorchCommunicator",
    "all_gather",
    "all_reduce_tensors",
    "communicator",
    "create_local_process_group",
    "destroy_local_process_group",
    "expand_slurm_nodelist",
    "gather",
    "gather_into_tensor",
    "get_dist_info",
    "get_global_rank",
    "get_local_process_group",
    "get_local_rank",
    "get_local_size",
    "get_local_world_size",
    "get_rank",
    "get_world_size",
    "global_print",
    "init_dist",
    "initialize_ddp",
    "is_dist_active",
    "is_main_process",
    "is_using_torchrun",
    "launch",
    "launch_distributed_training",
    "local_print",
    "main_process_first",
    "on_rank",
    "parallel_on_all_devices",
    "parallelize_on_gpus",
    "parse_distributed_env",
    "print_gpu_memory_stats",
    "print_gpu_memory_usage",
    "reduce_dict",
    "record",
    "resolve_device",
    "safe_barrier",
    "shared_random_seed",
    "should_use_distributed",
    "shutdown_dist",
    "synchronize",
]
