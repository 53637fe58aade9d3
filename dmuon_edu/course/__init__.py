"""The course: what only the notebooks need, built on the library.

Nothing here is imported by the library (``dmuon_edu`` outside this folder); this
package imports the library.

- ``notebooks``: learner notebooks and scripts built from the solutions; ``grading``:
  running them headless and reading the verdicts; ``cli``: ``python -m dmuon_edu.course``.
- ``checks``: the check cells' checkers, one submodule per course module.
- ``pitfalls``: the classic accumulation bugs as runnable functions; ``amp_pitfalls``: the
  GradScaler rules, each broken by a runnable loop; ``widgets``: the learning-rate scaling
  and cost-model widgets.
- ``ns_design``: Newton–Schulz coefficients judged by their composed polynomial, the published
  Polar Express variants, and what Newton–Schulz costs next to a training step.
- ``data_parallel`` and ``dmuon_problem``: the shared problems and single-process
  baselines of the data-parallel and dmuon exercises; ``cost_model``: what each scheme
  holds and sends per rank; ``timeline``: layer spans and collectives on one clock.
- ``gpt``, ``data`` and ``capstone``: the capstone's small GPT, its Markov text, and its
  training runs; ``threads``: one torch thread for small problems.
"""
