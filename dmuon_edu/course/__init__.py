"""The course: what only the notebooks need, built on the library.

Nothing here is imported by the library (``dmuon_edu`` outside this folder); this
package imports the library.

- ``notebooks``: learner notebooks and scripts built from the solutions; ``grading``:
  running them headless and reading the verdicts; ``cli``: ``python -m dmuon_edu.course``.
- ``checks``: the check cells' checkers, one submodule per course module.
- ``pitfalls``: the classic accumulation bugs as runnable functions; ``widgets``: the
  learning-rate scaling widget.
- ``data_parallel`` and ``dmuon_problem``: the shared problems and single-process
  baselines of the data-parallel and dmuon exercises.
- ``gpt``, ``data`` and ``capstone``: the capstone's small GPT, its Markov text, and its
  training runs; ``threads``: one torch thread for small problems.
"""
