"""dmuon_edu: gradient accumulation and distributed Muon, from one device to many.

The core, in the order the course builds it (imports flow one way):

- ``accumulation``: loss-scaled gradient accumulation on one device, and a training loop.
- ``newton_schulz``: Newton-Schulz orthogonalisation, three coefficient sets.
- ``muon``: Muon on one device, and the Muon/AdamW parameter split.
- ``dmuon``: distributed Muon with owner ranks, no_sync and Z2/Z3 (``from dmuon_edu import dmuon``).

Around it: ``data`` (generated token text), ``memory`` (peak memory), ``compare``
(parameter differences), ``launch`` (torchrun from a notebook), ``distributed``
(process group, rank-0 print, collective counts), ``data_parallel`` (the module 5
problem and baseline), ``pitfalls`` (the classic bugs, runnable), ``widgets``,
``checks`` (the self-checks) and ``course`` (learner notebooks and grading).
"""

from dmuon_edu.accumulation import accumulation_windows, summed_token_loss, train, train_step_with_accumulation
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.memory import peak_memory_bytes
from dmuon_edu.muon import Muon, muon_param_groups

__all__ = [
    "train_step_with_accumulation",
    "accumulation_windows",
    "summed_token_loss",
    "train",
    "max_parameter_difference",
    "peak_memory_bytes",
    "Muon",
    "muon_param_groups",
]
__version__ = "0.1.0"
