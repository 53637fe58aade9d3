"""dmuon_edu: gradient accumulation and distributed Muon, from one device to many.

The library (this package, outside ``dmuon_edu.course``) depends on torch and tqdm
only. Its modules, in the order they build on each other (each imports only modules
listed before it; tests/test_layout.py keeps it so):

- ``accumulation``: loss-scaled gradient accumulation on one device, and a training loop.
- ``newton_schulz``: Newton-Schulz orthogonalisation, with three coefficient sets.
- ``compare`` (parameter differences between two runs) and ``memory`` (peak memory of
  a piece of work).
- ``muon``: Muon on one device, and the Muon/AdamW parameter split.
- ``distributed``: joining torchrun's process group, a barrier, a rank-0 print, collective counts.
- ``launch``: torchrun from Python (a notebook cell, a test), with timeouts, named failures
  and no process left behind.
- ``checkpoint``: torch.distributed.checkpoint, all or nothing: a completion marker with the
  step and every file's checksum, verified before anything is loaded.
- ``dmuon``: distributed Muon with owner ranks, ``no_sync`` and Z2/Z3
  (``from dmuon_edu import dmuon``).

``dmuon_edu.course`` is built on top of the library and is not part of it: it imports
the library, and the library never imports it.
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
