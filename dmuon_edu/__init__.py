"""dmuon_edu: gradient accumulation and distributed Muon, from one device to many.

Modules, in the order the course builds them (imports flow one way):

- ``accumulation``: loss-scaled gradient accumulation on one device, and a training loop.
- ``memory``: peak memory of a piece of work, on CPU or CUDA.
- ``compare``: parameter-by-parameter comparison of two runs.
- ``pitfalls``: the classic accumulation bugs, runnable.
- ``checks``: the notebooks' self-checks.
- ``course``: builds learner notebooks from solutions and grades them.
"""

from dmuon_edu.accumulation import accumulation_windows, summed_token_loss, train, train_step_with_accumulation
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.memory import peak_memory_bytes

__all__ = [
    "train_step_with_accumulation",
    "accumulation_windows",
    "summed_token_loss",
    "train",
    "max_parameter_difference",
    "peak_memory_bytes",
]
__version__ = "0.1.0"
