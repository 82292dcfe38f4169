"""Per-step fault tolerance: a lost member's step is redone by the survivors, in their
processes, with no restart and no checkpoint read (docs/fault-tolerance.md).

Built on torchft (the ``ft`` extra): its Lighthouse decides each step's membership
(lighthouse.py, a process no member lives in), its Manager and reconfigurable gloo group carry
one member's steps (replica.py); collectives go through a Communicator over that group
(communicator.py), and a member that joins receives the state verified with the checkpoints'
checksums, never unpickled (transport.py). A Replica may be one rank of a member of several
(group_rank, group_size: rank i sums and heals with rank i of the others, and a step needs
every rank's vote), and a sharded member's state travels rank by rank as local shards with
their layout (shards.py): the first parts of sharded members, not yet wired into the mode,
which still refuses FSDP. On one machine, a Supervisor (supervisor.py,
``nn-handler supervise``) starts the members and restarts only a dead one."""

from nn_handler.training.fault_tolerance.communicator import ReplicaCommunicator
from nn_handler.training.fault_tolerance.engine import require_torchft
from nn_handler.training.fault_tolerance.lighthouse import Lighthouse
from nn_handler.training.fault_tolerance.replica import Replica
from nn_handler.training.fault_tolerance.supervisor import Supervisor

__all__ = ["Lighthouse", "Replica", "ReplicaCommunicator", "Supervisor", "require_torchft"]
